"""Compiled Triton kernels shipped in an engine (kiln/runtime/kernel_cache.py): the copy in
and out of Triton's cache, the build's precompile step (kiln/cli/precompile.py) off CUDA and
when it fails, and what `kiln inspect` shows. The GPU side (the build's first start, a fresh
cache served from the engine) is tests/gpu/test_kernel_cache_gpu.py."""

from __future__ import annotations

import subprocess
import sys

from typer.testing import CliRunner

from kiln.builder import build_engine
from kiln.cli import precompile
from kiln.cli.app import app
from kiln.runtime import kernel_cache
from kiln.runtime.engine import LLMEngine, RuntimeConfig


def _fake_triton_cache(root, keys):
    for key in keys:
        d = root / key
        d.mkdir(parents=True)
        (d / "k.cubin").write_bytes(key.encode() * 10)
        (d / "k.json").write_text("{}")
        (d / "lock").write_text("")  # Triton's own bookkeeping: not shipped
    return root


def test_export_then_install_copies_missing_entries_only(tmp_path):
    src = _fake_triton_cache(tmp_path / "built", ["aaa", "bbb", "ccc"])
    engine = tmp_path / "engine"
    assert kernel_cache.export_kernels(src, engine, "triton-9.9-sm90") == 3
    assert kernel_cache.shipped_tags(engine) == ["triton-9.9-sm90"]
    assert not (engine / "kernels" / "triton-9.9-sm90" / "aaa" / "lock").exists()
    dest = _fake_triton_cache(tmp_path / "serving", ["bbb"])
    (dest / "bbb" / "k.cubin").write_bytes(b"theirs")
    assert kernel_cache.install_kernels(engine, "triton-9.9-sm90", dest) == {
        "shipped": 3, "installed": 2}
    assert (dest / "aaa" / "k.cubin").read_bytes() == b"aaa" * 10
    assert (dest / "bbb" / "k.cubin").read_bytes() == b"theirs"  # an existing entry stays
    assert sorted(p.name for p in dest.iterdir()) == ["aaa", "bbb", "ccc"]  # no leftovers
    assert kernel_cache.install_kernels(engine, "triton-9.9-sm90", dest)["installed"] == 0
    # another machine's tag: nothing to install
    assert kernel_cache.install_kernels(engine, "triton-9.9-sm100", tmp_path / "x") == {}


def test_installed_entries_are_cache_hits_for_triton(tmp_path, monkeypatch):
    """Triton's group files name a kernel's files by absolute path, and a group whose paths
    are gone is a miss (recompile). The build's cache is deleted after export, so installed
    groups must point into the serving cache: Triton's own cache manager must find them."""
    import shutil

    from triton.runtime.cache import FileCacheManager

    built = tmp_path / "built"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(built))
    mgr = FileCacheManager("KEY1")
    files = {name: mgr.put(data, name) for name, data in
             [("k.cubin", b"\x7fELF"), ("k.json", '{"name": "k"}')]}
    mgr.put_group("k.json", files)
    assert FileCacheManager("KEY1").get_group("k.json") is not None  # a hit where built
    engine = tmp_path / "engine"
    assert kernel_cache.export_kernels(built, engine, "triton-9.9-sm90") == 1
    shutil.rmtree(built)  # the build's temporary cache is gone
    shipped = next((engine / "kernels" / "triton-9.9-sm90" / "KEY1").glob("__grp__*"))
    assert str(tmp_path) not in shipped.read_text()  # no build paths in the artifact
    serving = tmp_path / "serving"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(serving))
    assert FileCacheManager("KEY1").get_group("k.json") is None  # a miss before install
    assert kernel_cache.install_kernels(engine, "triton-9.9-sm90", serving)["installed"] == 1
    group = FileCacheManager("KEY1").get_group("k.json")
    assert group is not None and set(group) == {"k.cubin", "k.json"}
    assert all(p.startswith(str(serving.resolve())) for p in group.values())
    # a cache that never missed on it: the entry is copied whole, groups relocated
    fresh = tmp_path / "fresh"
    assert kernel_cache.install_kernels(engine, "triton-9.9-sm90", fresh)["installed"] == 1
    monkeypatch.setenv("TRITON_CACHE_DIR", str(fresh))
    group = FileCacheManager("KEY1").get_group("k.json")
    assert group is not None and all(p.startswith(str(fresh.resolve())) for p in group.values())
    assert kernel_cache.install_kernels(engine, "triton-9.9-sm90", fresh)["installed"] == 0


def test_build_precompile_without_cuda_says_so_and_ships_nothing(tmp_path):
    out = tmp_path / "e"
    res = CliRunner().invoke(app, ["build", "random:tiny-llama", "-o", str(out),
                                   "--precompile-kernels"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    assert "kernel precompilation skipped: no CUDA" in res.stderr
    assert kernel_cache.shipped_tags(out) == []
    eng = LLMEngine.from_engine_dir(out, RuntimeConfig(device="cpu"))
    assert eng.kernels_installed == {} and "install_kernels_s" not in eng.startup_times


def test_inspect_lists_shipped_kernels(tmp_path):
    out = tmp_path / "e"
    build_engine("random:tiny-llama", out, progress=False)
    runner = CliRunner()
    res = runner.invoke(app, ["inspect", str(out)], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "--precompile-kernels" in res.output
    kernel_cache.export_kernels(_fake_triton_cache(tmp_path / "c", ["k1", "k2"]), out,
                                "triton-9.9-sm90")
    res = runner.invoke(app, ["inspect", str(out)], env={"COLUMNS": "200"})
    assert res.exit_code == 0 and "triton-9.9-sm90" in res.output and "2 kernels" in res.output


def test_warm_prefills_every_length_the_engine_takes(tmp_path):
    """The build's first start (run here on CPU: the same engine calls, no Triton cache)."""
    out = tmp_path / "e"
    build_engine("random:tiny-llama", out, progress=False, max_seq_len=64, max_input_len=20)
    info = precompile.warm(out, device="cpu")
    assert info["prompts"] == [n for n in precompile.WARM_PROMPT_LENS if n <= 20]
    assert info["tag"] is None and info["seconds"] > 0


def test_warm_entry_point_usage():
    res = subprocess.run([sys.executable, "-m", "kiln.cli.precompile"],
                         capture_output=True, text=True, check=False)
    assert res.returncode == 2 and "usage" in res.stderr


def test_install_for_engine_never_fails_the_start(tmp_path, monkeypatch, capsys):
    engine = tmp_path / "engine"
    kernel_cache.export_kernels(_fake_triton_cache(tmp_path / "built", ["aaa"]), engine,
                                "triton-9.9-sm90")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(kernel_cache, "cache_tag", lambda device=None: "triton-9.9-sm90")
    kernels, seconds = kernel_cache.install_for_engine(engine, "cuda")
    assert kernels == {"shipped": 1, "installed": 1} and seconds >= 0
    assert (tmp_path / "cache" / "aaa" / "k.cubin").exists()
    # another GPU or Triton: said once, nothing installed
    monkeypatch.setattr(kernel_cache, "cache_tag", lambda device=None: "triton-9.9-sm100")
    assert kernel_cache.install_for_engine(engine, "cuda")[0] == {}
    assert "ships compiled kernels for triton-9.9-sm90, not for this machine" in \
        capsys.readouterr().err
    # a Triton cache that cannot be written: a message, and the start goes on
    monkeypatch.setattr(kernel_cache, "cache_tag", lambda device=None: "triton-9.9-sm90")
    blocker = tmp_path / "file"
    blocker.write_text("")
    monkeypatch.setenv("TRITON_CACHE_DIR", str(blocker / "cache"))
    assert kernel_cache.install_for_engine(engine, "cuda")[0] == {}
    assert "could not install the engine's compiled kernels" in capsys.readouterr().err


def _fake_cuda_build(tmp_path, monkeypatch, argv):
    """Run the build's precompile step with CUDA 'available' and the warm subprocess
    replaced by ``argv`` (python arguments); returns what it printed on stderr."""
    import io

    import torch
    from rich.console import Console

    from kiln import env

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(precompile, "WARM_ARGV", argv)
    err = io.StringIO()
    monkeypatch.setattr(precompile, "Console", lambda **kw: Console(file=err, width=400))
    engine = tmp_path / "engine"
    engine.mkdir(parents=True)
    precompile.precompile_kernels(engine, Console(file=io.StringIO()), env.precompile_timeout_s())
    assert not (engine / "kernels").exists()  # nothing shipped, and the build goes on
    return err.getvalue()


def test_precompile_that_hangs_is_stopped_and_the_build_goes_on(tmp_path, monkeypatch):
    monkeypatch.setenv("KILN_PRECOMPILE_TIMEOUT_S", "0.5")
    err = _fake_cuda_build(tmp_path, monkeypatch, ["-c", "import time; time.sleep(60)"])
    assert "did not finish in 0.5 s" in err and "KILN_PRECOMPILE_TIMEOUT_S" in err


def test_precompile_that_fails_or_prints_no_result_warns(tmp_path, monkeypatch):
    err = _fake_cuda_build(tmp_path, monkeypatch,
                           ["-c", "import sys; print('boom', file=sys.stderr); sys.exit(3)"])
    assert "kernel precompilation failed" in err and "boom" in err
    err = _fake_cuda_build(tmp_path / "b", monkeypatch, ["-c", "print('not json')"])
    assert "printed no result line" in err and "not json" in err


def test_bad_precompile_timeout_fails_before_the_build_starts(tmp_path, monkeypatch):
    from kiln.errors import KilnError

    monkeypatch.setenv("KILN_PRECOMPILE_TIMEOUT_S", "soon")
    build = ["build", "random:tiny-llama", "-o", str(tmp_path / "e")]
    res = CliRunner().invoke(app, build)  # the default: precompile when CUDA is available
    assert isinstance(res.exception, KilnError)
    assert "KILN_PRECOMPILE_TIMEOUT_S='soon'" in str(res.exception)
    assert not (tmp_path / "e").exists()
    # not asked to precompile: the variable is not read
    res = CliRunner().invoke(app, [*build, "--no-precompile-kernels"])
    assert res.exit_code == 0, res.output


def test_precompiled_kernels_land_with_the_engine_or_not_at_all(tmp_path):
    """The precompile step runs on the complete temp dir before the rename: what it adds is
    in the engine when it appears; when it fails, no engine (and no temp dir) is left."""
    import pytest

    out = tmp_path / "e"
    seen = []

    def finish(tmp):
        assert (tmp / "engine.json").is_file() and not out.exists()
        kernel_cache.export_kernels(_fake_triton_cache(tmp_path / "c", ["k1"]), tmp,
                                    "triton-9.9-sm90")
        seen.append(tmp)

    build_engine("random:tiny-llama", out, progress=False, finish=finish)
    assert kernel_cache.shipped_kernels(out) == {"triton-9.9-sm90": 1}
    assert not seen[0].exists()

    def fail(tmp):
        raise RuntimeError("export failed")

    with pytest.raises(RuntimeError, match="export failed"):
        build_engine("random:tiny-llama", tmp_path / "f", progress=False, finish=fail)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c", "e"]
