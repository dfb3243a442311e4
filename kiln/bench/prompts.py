"""Bundled prompts (written for kiln): chat questions and code tasks.

Used by correctness checks against transformers and by ``kiln bench latency`` to compare
plain and speculative decoding on realistic text.
"""

from __future__ import annotations

CHAT_PROMPTS = [
    "Write a haiku about kilns.",
    "What is the capital of France? Answer in one sentence.",
    "Explain in two sentences why the sky is blue.",
    "List three tips for staying focused while studying.",
    "Describe how bread rises, step by step.",
    "Give me a short packing list for a weekend hiking trip.",
]

CODE_PROMPTS = [
    "Write a Python function that returns the n-th Fibonacci number iteratively.",
    "Write a Python function is_palindrome(s) that ignores case and spaces.",
    "Write a Python class Stack with push, pop, peek and is_empty methods.",
    "Write a Python function that counts how often each word appears in a text.",
    "Write a Python function binary_search(items, target) returning the index or -1.",
    "Write a Python function that merges two sorted lists into one sorted list.",
]
