"""Diagnostics (scripts/device_profile.sh s2): with KILN_JIT_LOG=FILE and this folder on
PYTHONPATH, every Triton JIT specialisation a process meets (before the disk-cache lookup) is
appended to FILE as one JSON line, in this process and its subprocesses alike."""

import json
import os

_path = os.environ.get("KILN_JIT_LOG")
if _path:
    try:
        from triton import knobs

        def _hook(**kw):
            comp = kw.get("compile") or {}
            with open(_path, "a") as f:
                f.write(json.dumps({"pid": os.getpid(), "repr": kw.get("repr"),
                                    "spec": comp.get("specialization_data")}) + "\n")

        knobs.runtime.jit_cache_hook = _hook
    except Exception as e:  # noqa: BLE001 - diagnostics only
        print(f"jitlog: hook not installed: {e}")
