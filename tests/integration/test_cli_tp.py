"""`kiln build --tp` and `kiln generate` of a tp-2 engine through the real console entry
point: the ranks start, answer as the tp-1 engine does, and are gone afterwards."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from helpers import rank_workers
from test_cli_build import kiln

from kiln.builder import build_engine


def _workers_of(engine: Path) -> list[str]:
    """``PID COMMAND-LINE`` of live processes running a rank of ``engine``."""
    return [f"{pid} {cmd}" for pid, cmd in rank_workers(engine).items()]


def test_generate_on_a_tp2_engine_matches_tp1_and_leaves_no_rank(tiny_hf_model, tmp_path):
    src = str(tiny_hf_model("qwen2"))
    one, two = tmp_path / "tp1", tmp_path / "tp2"
    build_engine(src, one, dtype="float32", max_seq_len=128, progress=False, tune=False)
    r = kiln("build", src, "-o", str(two), "--tp", "2", "--dtype", "float32", "--max-seq-len",
             "128", "--no-tune", "--json")
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["parallel"]["shards"] == [
        "weights-rank0-of-2.safetensors", "weights-rank1-of-2.safetensors"]
    args = ("hello there", "--raw", "--device", "cpu", "--temperature", "0", "--max-tokens",
            "12", "--ignore-eos", "--json")
    want = kiln("generate", str(one), *args)
    got = kiln("generate", str(two), *args)
    assert want.returncode == 0, want.stderr
    assert got.returncode == 0, got.stderr
    assert json.loads(got.stdout)["token_ids"] == json.loads(want.stdout)["token_ids"]
    assert len(json.loads(got.stdout)["token_ids"]) == 12
    assert _workers_of(two) == []


def test_build_error_names_the_heads_and_the_tp_values_that_work(tmp_path):
    r = kiln("build", "random:smollm2-135m", "-o", str(tmp_path / "e"), "--tp", "2")
    assert r.returncode == 1 and "Traceback" not in r.stderr
    assert r.stderr.startswith("error: --tp 2: num_attention_heads=9 is not divisible by tp=2")
    assert "splits with --tp 1, 3" in r.stderr
    assert not (tmp_path / "e").exists()


def test_generate_exits_1_naming_a_rank_that_stops_mid_generation(tmp_path):
    """`kiln generate` streams; the follower is stopped (SIGSTOP) once text arrives. With a
    2 s heartbeat timeout the command ends within seconds: exit code 1, one error line
    naming the rank, no traceback, no rank left."""
    engine = tmp_path / "tp2"
    build_engine("random:tiny-llama", engine, dtype="float32", max_seq_len=512, tp=2,
                 progress=False)
    env = {**os.environ, "KILN_TP_HEARTBEAT_TIMEOUT_S": "2",
           "PYTHONPATH": os.pathsep.join(sys.path)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kiln", "generate", str(engine), "kilns", "--raw", "--device",
         "cpu", "--temperature", "0", "--max-tokens", "480", "--ignore-eos"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
    try:
        assert proc.stdout.read(1)  # generation is under way
        (worker,) = _workers_of(engine)
        os.kill(int(worker.split()[0]), signal.SIGSTOP)
        t0 = time.monotonic()
        assert proc.wait(20) == 1
        assert time.monotonic() - t0 < 15
        err = proc.stderr.read().decode()
        assert "Traceback" not in err, err
        assert re.search(r"^error: tensor-parallel engine \(tp=2\) stopped: rank 1 sent no "
                         r"heartbeat for 2\.\d s", err, re.MULTILINE), err
        assert _workers_of(engine) == []
    finally:
        proc.kill()
        proc.wait()


def test_bench_reports_tp_and_every_ranks_peak_memory(tmp_path):
    """`kiln bench latency` and `throughput` on a tp-2 engine: tp 2 and a peak-memory row
    per rank in the table and in --json (the follower's numbers come over the control
    channel: its own process, not rank 0's), latency's collectives per decode step, and no
    rank left afterwards."""
    engine = tmp_path / "tp2"
    build_engine("random:tiny-llama", engine, dtype="float32", max_seq_len=128, tp=2,
                 progress=False)
    for bench, args in (("latency", ("--batch-size", "2", "--input-len", "8", "--output-len",
                                     "4", "--num-iters", "1", "--warmup", "0")),
                        ("throughput", ("--num-prompts", "3", "--input-len", "8",
                                        "--output-len", "4"))):
        path = tmp_path / f"{bench}.json"
        r = kiln("bench", bench, str(engine), *args, "--device", "cpu", "--json", str(path))
        assert r.returncode == 0, r.stderr
        assert "Peak memory by rank (tp 2)" in r.stdout, r.stdout
        got = json.loads(path.read_text())
        assert got["tp"] == 2 and len(got["memory_by_rank"]) == 2
        for m in got["memory_by_rank"]:
            assert m["device"] == "cpu" and m["device_peak_bytes"] is None
            assert m["peak_rss_bytes"] > 50 * 2**20  # a process with torch loaded
        if bench == "latency":  # each decode step's collectives, found by the profiler
            c = got["collectives"]
            # tiny-llama's 2 layers: o_proj and down each, and the embedding; the logits
            assert c["all_reduce_calls_per_step"] == 5 and c["gather_calls_per_step"] == 1, c
            assert c["all_reduce_ms_per_step"] > 0 and c["source"] == "gloo operations (rank 0)"
            assert "collectives per decode step, batch 2" in r.stdout, r.stdout
        assert _workers_of(engine) == []


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_nodes(cmds: list[list[str]], env: dict) -> tuple[list, list[tuple[str, str]]]:
    """Run each torchrun "node" command at once; (the processes, their (stdout, stderr))."""
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
                              text=True) for cmd in cmds]
    try:
        return nodes, [node.communicate(timeout=240) for node in nodes]
    finally:
        for node in nodes:
            node.kill()
            node.wait()


def test_generate_across_two_torchrun_nodes_matches_tp1_and_leaves_no_rank(tmp_path):
    """The README's two-host commands on loopback: two torchrun "nodes" of one rank each
    (c10d rendezvous), both running the same `kiln generate` of a tp-2 engine. torchrun's
    rank 0 prints the tp-1 engine's greedy tokens, the other follows and prints nothing,
    both exit 0 and no rank is left."""
    one, two = tmp_path / "tp1", tmp_path / "tp2"
    for out, tp in ((one, 1), (two, 2)):
        build_engine("random:tiny-llama", out, dtype="float32", max_seq_len=128, tp=tp,
                     progress=False)
    args = ("generate", str(two), "hello there", "--raw", "--device", "cpu", "--temperature",
            "0", "--max-tokens", "8", "--ignore-eos", "--json")
    want = kiln(*args[:1], str(one), *args[2:])
    assert want.returncode == 0, want.stderr
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    port = _free_port()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
           "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
           "--max-restarts", "0", "-m", "kiln", *args]
    nodes, outs = _run_nodes([cmd, cmd], env)
    for node, (_, err) in zip(nodes, outs):
        assert node.returncode == 0, err
    printed = [out for out, _ in outs if out.strip()]
    assert len(printed) == 1, outs  # rank 0's node; the follower runs no command
    assert json.loads(printed[0])["token_ids"] == json.loads(want.stdout)["token_ids"]
    assert _workers_of(two) == []
    for proc in Path("/proc").iterdir():  # no torchrun worker of this engine either
        try:
            cmd_line = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        assert not (str(two) in cmd_line and "-m kiln" in cmd_line
                    and proc.name != str(os.getpid())), cmd_line


def test_a_host_with_another_engine_is_one_clear_error(tmp_path):
    """Two torchrun nodes (static rendezvous: node 0 is rank 0) whose engine directories
    differ (another build of the model, as a stale copy on one host would be): the follower
    refuses before loading weights, rank 0 exits 1 naming why, and so does the follower."""
    engines = [tmp_path / "a", tmp_path / "b"]
    for out, seq in zip(engines, (128, 256)):
        build_engine("random:tiny-llama", out, dtype="float32", max_seq_len=seq, tp=2,
                     progress=False)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "OMP_NUM_THREADS": "1"}
    port = _free_port()
    nodes, outs = _run_nodes([
        [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1",
         "--node-rank", str(rank), "--master-addr", "127.0.0.1", "--master-port", str(port),
         "--max-restarts", "0", "-m", "kiln", "generate", str(engine), "hello", "--raw",
         "--device", "cpu", "--max-tokens", "4"] for rank, engine in enumerate(engines)], env)
    assert all(node.returncode != 0 for node in nodes), outs
    err = outs[0][1]
    assert "rank 1 failed: ValueError: the engine at" in err and "is not rank 0's" in err, err
    assert "copy the same engine directory to every host" in err, err
