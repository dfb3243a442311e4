"""Bundled prompts (written for kiln): input-grounded tasks, code tasks, chat questions and
agentic turns.

Used by correctness checks against transformers and by ``kiln bench latency`` to compare
plain and speculative decoding on realistic text. The grounded tasks carry the code or data
the answer copies from (rename, add hints, fix, convert to JSON): the text speculation can
draft from. The agentic turns repeat a task with small changes (the same tool called with
other arguments, the same function re-emitted with another edit), none verbatim: what a
cache of earlier answers (suffix decoding) drafts from. Each stays under ~400 characters so
it fits the tiny 512-token test engines.
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

GROUNDED_PROMPTS = [
    "Rename the variable `n` to `count` in this code and change nothing else:\n"
    "```python\n"
    "def tally(words):\n"
    "    n = {}\n"
    "    for w in words:\n"
    "        n[w] = n.get(w, 0) + 1\n"
    "    return n\n"
    "```",
    "Add type hints to this function and change nothing else:\n"
    "```python\n"
    "def block_count(num_tokens, block_size, reserve=0):\n"
    "    if block_size <= 0:\n"
    "        raise ValueError(\"block_size must be positive\")\n"
    "    blocks = -(-num_tokens // block_size)\n"
    "    return blocks + reserve\n"
    "```",
    "Convert this list to a JSON array of objects with keys \"name\", \"dtype\" and "
    "\"size_gb\":\n"
    "- smollm2-135m, bfloat16, 0.27\n"
    "- qwen2.5-0.5b, bfloat16, 0.99\n"
    "- qwen2.5-1.5b, float16, 3.09\n"
    "- llama-3-8b, fp8, 8.03\n"
    "- qwen2.5-7b, bfloat16, 15.2",
    "Fix the bug in this function (it should return the mean of the last k values):\n"
    "```python\n"
    "def moving_mean(values, k):\n"
    "    window = values[-k:]\n"
    "    total = 0\n"
    "    for v in window:\n"
    "        total += v\n"
    "    return total / k\n"
    "```\n"
    "It is wrong when there are fewer than k values. Show the fixed function.",
    "Edit this function so that it also skips lines that start with `#`:\n"
    "```python\n"
    "def read_pairs(path):\n"
    "    pairs = {}\n"
    "    with open(path) as f:\n"
    "        for line in f:\n"
    "            line = line.strip()\n"
    "            if not line:\n"
    "                continue\n"
    "            key, value = line.split(\"=\", 1)\n"
    "            pairs[key.strip()] = value.strip()\n"
    "    return pairs\n"
    "```",
    "Rewrite this loop as a list comprehension, keeping the names:\n"
    "```python\n"
    "ready = []\n"
    "for req in requests:\n"
    "    if req.status == \"waiting\" and req.num_tokens <= budget:\n"
    "        ready.append(req.request_id)\n"
    "```",
    "Convert this table to JSON, one object per row, numbers as numbers:\n"
    "window | tokens_per_step | speedup\n"
    "3,3,2  | 10              | 1.12\n"
    "4,4,4  | 24              | 1.31\n"
    "5,5,5  | 40              | 1.27\n"
    "7,7,7  | 84              | 1.08",
    "Add a docstring to this class and its method, and change nothing else:\n"
    "```python\n"
    "class Timer:\n"
    "    def __init__(self):\n"
    "        self.start = time.perf_counter()\n"
    "\n"
    "    def lap(self):\n"
    "        now = time.perf_counter()\n"
    "        elapsed, self.start = now - self.start, now\n"
    "        return elapsed\n"
    "```",
]

_WEATHER = ("Tool: get_weather(city: string, unit: \"celsius\" | \"fahrenheit\"). Reply with "
            "only the JSON tool call {\"name\": ..., \"arguments\": {...}} for: ")
_ORDER = ("Tool: lookup_order(order_id: string, fields: array of \"status\" | \"eta\" | "
          "\"carrier\"). Reply with only the JSON tool call {\"name\": ..., \"arguments\": "
          "{...}} for: ")
_FETCH = ("Return this function with {edit}, and change nothing else:\n"
          "```python\n"
          "def fetch(url, timeout=30, retries=2):\n"
          "    for attempt in range(retries + 1):\n"
          "        try:\n"
          "            return http.get(url, timeout=timeout)\n"
          "        except TimeoutError:\n"
          "            if attempt == retries:\n"
          "                raise\n"
          "```")

# each task twice in a row: any first few prompts of the set hold a repeated task
AGENTIC_PROMPTS = [
    _WEATHER + "the weather in Paris, in celsius.",
    _WEATHER + "the weather in Tokyo, in fahrenheit.",
    _FETCH.format(edit="`timeout=30` changed to `timeout=60`"),
    _FETCH.format(edit="`retries=2` changed to `retries=5`"),
    _ORDER + "the status and eta of order A-1042.",
    _ORDER + "the status and carrier of order B-2210.",
]
