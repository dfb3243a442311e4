"""The README as a new user runs it: its commands, taken from README.md and run literally
through the `kiln` console script (real subprocesses, the real built-in model).

Only what a CPU runner cannot afford is added to a command (a small calibration, a few
output tokens), always as extra flags after the README's own. The built-in model's GGUF
comes from the session cache (``smollm2_gguf``); engines are built into a per-module
``KILN_CACHE`` so that a test never reuses an engine an older kiln built.

On the 2-core CPU runner: the quantize path ~45 s, the top section (serve + curl, build +
generate) ~60 s, the rest a few seconds.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import module_dir

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")


# --- reading the README ----------------------------------------------------------------------


def section(heading: str) -> str:
    """The README text under the heading that starts with ``heading`` (up to the next heading
    of the same or a higher level)."""
    lines = README.splitlines()
    for i, line in enumerate(lines):
        if line.startswith("#") and line.lstrip("#").strip().startswith(heading):
            level = len(line) - len(line.lstrip("#"))
            end = next((j for j in range(i + 1, len(lines))
                        if re.match(rf"#{{1,{level}}} ", lines[j])), len(lines))
            return "\n".join(lines[i + 1:end])
    raise AssertionError(f"README has no heading {heading!r}")


def code_blocks(text: str) -> list[str]:
    return re.findall(r"^```(?:bash|sh)?\n(.*?)^```", text, flags=re.S | re.M)


def commands(block: str) -> list[list[str]]:
    """The shell commands of a code block, each as argv (comments dropped, `&&` split,
    indented lines continue the previous command, as a multi-line quoted body does)."""
    logical: list[str] = []
    for line in block.splitlines():
        if line[:1].isspace() and logical:
            logical[-1] += "\n" + line
        elif line.strip():
            logical.append(line)
    out = []
    for cmd in logical:
        argv = shlex.split(cmd.replace("\\\n", " "), comments=True)
        while "&&" in argv:
            i = argv.index("&&")
            out.append(argv[:i])
            argv = argv[i + 1:]
        if argv:
            out.append(argv)
    return out


def kiln_commands(text: str) -> list[list[str]]:
    return [c for b in code_blocks(text) for c in commands(b) if c[0] == "kiln"]


# --- running kiln ----------------------------------------------------------------------------


def kiln_exe() -> list[str]:
    """The console script a user runs (`kiln`, beside this interpreter), else `python -m`."""
    script = Path(sys.executable).with_name("kiln")
    return [str(script)] if script.is_file() else [sys.executable, "-m", "kiln"]


def run(argv: list[str], *extra: str, cwd: Path, env: dict | None = None,
        timeout: float = 600) -> subprocess.CompletedProcess:
    assert argv[0] == "kiln", argv
    full_env = {**os.environ, "NO_COLOR": "1", "PYTHONIOENCODING": "utf-8", **(env or {})}
    full_env.pop("KILN_DEBUG", None)
    return subprocess.run([*kiln_exe(), *argv[1:], *extra], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=timeout, check=False)


def ok(proc: subprocess.CompletedProcess) -> subprocess.CompletedProcess:
    assert proc.returncode == 0, (f"{proc.args} exited {proc.returncode}\nstdout:\n"
                                  f"{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}")
    return proc


@pytest.fixture(scope="module")
def kiln_cache(smollm2_gguf, tmp_path_factory) -> Path:
    """A fresh KILN_CACHE holding (a link to) the verified built-in GGUF, no engines."""
    with module_dir(tmp_path_factory, "kiln-cache") as cache:
        (cache / "smollm2-135m").mkdir()
        (cache / "smollm2-135m" / smollm2_gguf.name).symlink_to(smollm2_gguf)
        yield cache


# --- Install ---------------------------------------------------------------------------------


def test_install_says_how_to_install_on_cpu_only_and_cuda_machines():
    """`pip install -e .` alone pulls a CUDA torch (GBs) on a CPU-only machine: the README
    installs torch from PyTorch's CPU index first there, and says what to do on CUDA."""
    text = section("Install")
    cmds = [c for b in code_blocks(text) for c in commands(b)]
    cpu_torch = ["pip", "install", "torch", "--index-url", "https://download.pytorch.org/whl/cpu"]
    assert cpu_torch in [c[-5:] for c in cmds], cmds
    at = [c[-5:] for c in cmds].index(cpu_torch)
    assert any(c[:2] == ["pip", "install"] and "-e" in c for c in cmds[at + 1:]), cmds
    assert re.search(r"CPU-only", text) and re.search(r"CUDA", text)


_STUB = """#!/usr/bin/env bash
echo "$(basename "$0") $*" >> "$STUB_LOG"
case "$*" in "-c import torch") exit 1 ;; esac
case "$*" in *download.pytorch.org*) [ -n "$STUB_NO_CPU_INDEX" ] && exit 1 ;; esac
exit 0
"""


@pytest.mark.parametrize("gpu,cpu_index", [(False, True), (True, True), (False, False)],
                         ids=["cpu-only", "nvidia", "cpu-only-pypi-only"])
def test_quickstart_installs_the_right_torch_then_serves(tmp_path, gpu, cpu_index):
    """`bash quickstart.sh` (the Install section's one command), with the venv's python and
    kiln stubbed to log their arguments: torch from the CPU index without an NVIDIA GPU
    (PyPI's when that index is out of reach, as on a machine that reaches PyPI only), PyPI's
    with one, then kiln, then `kiln serve smollm2-135m ARGS`."""
    assert ["bash", "quickstart.sh"] in [c for b in code_blocks(section("Install"))
                                         for c in commands(b)]
    venv, bin_dir, log = tmp_path / "venv", tmp_path / "bin", tmp_path / "log"
    (venv / "bin").mkdir(parents=True)
    bin_dir.mkdir()
    stubs = [venv / "bin" / "python", venv / "bin" / "kiln"]
    if gpu:
        stubs.append(bin_dir / "nvidia-smi")
    for stub in stubs:
        stub.write_text(_STUB)
        stub.chmod(0o755)
    path = os.pathsep.join([str(bin_dir), "/usr/bin", "/bin"])
    r = subprocess.run(["bash", str(REPO / "quickstart.sh"), "--port", "0"], capture_output=True,
                       text=True, timeout=60, env={"PATH": path, "KILN_VENV": str(venv),
                                                   "STUB_LOG": str(log), "HOME": str(tmp_path),
                                                   "STUB_NO_CPU_INDEX": "" if cpu_index else "1"})
    assert r.returncode == 0, r.stderr
    torch = ["python -m pip install torch"] if gpu else [
        "python -m pip install torch --index-url https://download.pytorch.org/whl/cpu"]
    if not cpu_index:
        torch.append("python -m pip install torch")
        assert "PyTorch's CPU index is out of reach" in r.stderr
    calls = [c for c in log.read_text().splitlines() if not c.startswith("nvidia-smi")]
    assert calls == ["python -c import torch", *torch, "python -m pip install -e .",
                     "kiln serve smollm2-135m --port 0"], calls


def test_speculative_section_says_bf16_greedy_can_differ_from_plain_greedy():
    """Rounding, not a bug: said where speculative decoding is described, so nobody files it."""
    text = " ".join(section("Speculative decoding").split())
    assert ("In bfloat16 (and float16) a speculative engine's greedy output can differ from "
            "the same engine's plain greedy output") in text
    assert "not a bug" in text and "--dtype float32" in text


# --- Run it on the built-in model ------------------------------------------------------------


def curl_requests(text: str) -> list[tuple[list[str], dict, dict, str]]:
    """(the `kiln serve` argv a curl follows, headers, JSON body, path) for every curl in
    ``text``'s code blocks, in order."""
    found = []
    serve: list[str] | None = None
    for block in code_blocks(text):
        for argv in commands(block):
            if argv[:2] == ["kiln", "serve"]:
                serve = argv
            elif argv[0] == "curl":
                assert serve is not None, f"a curl before any `kiln serve`: {argv}"
                headers = dict(h.split(": ", 1) for flag, h in zip(argv, argv[1:])
                               if flag == "-H")
                body = json.loads(argv[argv.index("-d") + 1])
                url = next(a for a in argv if "localhost:" in a or "127.0.0.1:" in a)
                found.append((serve, headers, body, "/" + url.split("/", 1)[1]))
    return found


def serve_and_send(serve_argv: list[str], requests: list[tuple[dict, dict, str]],
                   env: dict) -> list[str]:
    """Start the README's `kiln serve ...` (on a free port) and send it the curl bodies;
    returns each response's text."""
    httpx = pytest.importorskip("httpx")
    from kiln.server.testing import ServerProcess

    args = serve_argv[2:]
    if "--port" in args:  # a free port instead of the README's 8000
        i = args.index("--port")
        del args[i:i + 2]
    texts = []
    with ServerProcess(args[0], *args[1:], env=env, timeout_s=300) as server:
        for headers, body, path in requests:
            body = {**body, "max_tokens": min(int(body.get("max_tokens", 16)), 16)}
            r = httpx.post(server.url + path, headers=headers, json=body, timeout=120)
            assert r.status_code == 200, (serve_argv, body, r.status_code, r.text)
            texts.append(r.text)
    return texts


def test_run_it_on_the_builtin_model(kiln_cache, tmp_path):
    """The README's first section, command by command: `kiln serve smollm2-135m` answers the
    curl that follows it (the model name it serves under is the one the curl sends), and
    `kiln build ... && kiln generate ...` works."""
    text = section("Run it on the built-in model")
    env = {"KILN_CACHE": str(kiln_cache)}
    reqs = curl_requests(text)
    assert reqs and all(serve == ["kiln", "serve", "smollm2-135m"] for serve, *_ in reqs)
    (answer,) = serve_and_send(reqs[0][0], [r[1:] for r in reqs], env)
    assert json.loads(answer)["choices"][0]["message"]["content"].strip()
    # the engine it built records the model's sampling defaults (SmolLM2's model card)
    (cached,) = (kiln_cache / "engines").iterdir()
    spec = json.loads(ok(run(["kiln", "inspect", str(cached), "--json"], cwd=tmp_path)).stdout)
    assert spec["generation_defaults"]["values"] == {"temperature": 0.2, "top_p": 0.9}
    cmds = kiln_commands(text)
    assert ["kiln", "generate", "smollm2-135m"] in [c[:3] for c in cmds]  # a source works too
    for argv in cmds:
        if argv[1] != "serve":
            extra = ("--max-tokens", "4") if argv[1] == "generate" else ()
            proc = ok(run(argv, *extra, cwd=tmp_path, env=env))
            if argv[1] == "generate":
                assert proc.stdout.strip()


def test_serve_examples_send_the_served_model_name(kiln_cache):
    """Every curl in the `kiln serve` section goes to the server the line before it starts
    (with its --api-key); a model name that server does not serve would be a 404."""
    reqs = curl_requests(section("`kiln serve ENGINE_OR_SOURCE`"))
    assert reqs
    by_server: dict[tuple[str, ...], list] = {}
    for serve, *req in reqs:
        by_server.setdefault(tuple(serve), []).append(req)
    for serve, sent in by_server.items():
        for body in serve_and_send(list(serve), sent, {"KILN_CACHE": str(kiln_cache)}):
            assert body.rstrip().endswith("data: [DONE]") or json.loads(body)["choices"]


# --- kiln quantize ---------------------------------------------------------------------------


def test_quantize_section_on_the_builtin_gguf(kiln_cache, tmp_path):
    """The README's FP8 path on the GGUF built-in: quantize (a 2 x 32-token calibration
    instead of 64 x 256), build the checkpoint, generate from it."""
    cmds = kiln_commands(section("`kiln quantize MODEL -o CKPT` (FP8)"))
    quantize, build = cmds[0], cmds[1]
    generate = next(c for c in cmds if c[1] == "generate")
    assert quantize == shlex.split("kiln quantize smollm2-135m -o ckpt/smol-fp8 --qformat fp8 "
                                   "--kv-cache-dtype fp8")
    assert build == shlex.split("kiln build ckpt/smol-fp8 -o engines/smol-fp8")
    env = {"KILN_CACHE": str(kiln_cache)}
    # the quality gate scores a short text here (the built-in eval set: ~2,700 tokens)
    (tmp_path / "eval.txt").write_text(
        "A kiln is a thermally insulated chamber, a type of oven, that produces temperatures "
        "sufficient to complete some process, such as hardening, drying, or chemical changes. "
        "Kilns have been used for millennia to turn objects made from clay into pottery, "
        "bricks and tiles.\n")
    summary = json.loads(ok(run(quantize, "--calib-size", "2", "--calib-seq-len", "32",
                                "--eval-file", "eval.txt", "--allow-quality-loss", "--json",
                                cwd=tmp_path, env=env)).stdout)
    assert summary["calib_size"] == 2 and summary["source"]["alias"] == "smollm2-135m"
    gate = summary["quality"]  # both perplexities measured (2 x 32 calibration tokens)
    assert gate["eval_data"].endswith("eval.txt") and abs(gate["increase"]) < 0.25, gate
    ckpt = tmp_path / "ckpt" / "smol-fp8"
    config = json.loads((ckpt / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    proc = ok(run(build, "--json", cwd=tmp_path, env=env))
    assert "WARNING" not in proc.stderr, proc.stderr
    spec = json.loads(proc.stdout)
    q = spec["quantization"]
    assert (q["weights"], q["activations"], q["kv_cache"]) == ("fp8", "fp8", "fp8")
    assert q["scales"]["kv_cache"] == "checkpoint (calibrated)"
    # the checkpoint carries the built-in model's sampling defaults on to its engine
    assert spec["generation_defaults"]["values"] == {"temperature": 0.2, "top_p": 0.9}
    # two tokens: the FP8 linears run dequantized on the CPU (seconds per token on 2 cores)
    out = ok(run(generate, "--max-tokens", "2", "--json", cwd=tmp_path, env=env)).stdout
    assert json.loads(out)["token_ids"]


# --- Commands: exit codes and --help ---------------------------------------------------------


def test_exit_codes_are_as_documented(tmp_path):
    """README: errors exit 1, usage errors (a bad flag, a missing argument) exit 2."""
    text = section("Commands")
    assert re.search(r"exit code 1", text)
    assert re.search(r"usage errors?[^.]*exit code 2", text, flags=re.I)
    assert run(["kiln", "inspect", str(tmp_path / "nope")], cwd=tmp_path).returncode == 1
    assert run(["kiln", "build", "random:tiny-llama"], cwd=tmp_path).returncode == 2
    assert run(["kiln", "generate", "x", "hi", "--max-tokens", "many"],
               cwd=tmp_path).returncode == 2


def _leaf_commands():
    import typer

    from kiln.cli.app import app

    def walk(cmd, path: list[str]):
        if hasattr(cmd, "commands"):  # a group (typer may vendor its own click)
            for name, sub in cmd.commands.items():
                yield from walk(sub, [*path, name])
        else:
            yield path, cmd

    return list(walk(typer.main.get_command(app), []))


@pytest.mark.parametrize("path", [p for p, _ in _leaf_commands()], ids=" ".join)
def test_help_at_80_columns_shows_every_option_name(path, tmp_path):
    """`kiln CMD --help` in an 80-column terminal: every option name in full, no line wider
    than the terminal (rich's tables used to cut names to `--max-batch-si…`)."""
    cmd = dict((tuple(p), c) for p, c in _leaf_commands())[tuple(path)]
    proc = ok(run(["kiln", *path, "--help"], cwd=tmp_path,
                  env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"}))
    assert "…" not in proc.stdout
    assert max(map(len, proc.stdout.splitlines())) <= 80, proc.stdout
    names = [o for p in cmd.params for o in (*p.opts, *p.secondary_opts) if o.startswith("-")]
    words = set(re.findall(r"(?<![\w-])-{1,2}[\w-]+", proc.stdout))
    assert set(names) <= words, sorted(set(names) - words)

