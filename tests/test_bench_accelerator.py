"""``benchmarks/bench_accelerator.py`` runs on CPU (tiny sizes) and labels what it measured.

A smoke test, not a benchmark: it asserts no timing. The script runs in a fresh process
(``spawn_python``, so the slow tier), as a user runs it.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "bench_accelerator.py"


def test_benchmark_runs_on_cpu_and_labels_interpret_mode(tmp_path, spawn_python):
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    proc = spawn_python.run(
        [str(SCRIPT), "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "device: cpu (cpu)" in proc.stdout.lower()
    results = json.loads((tmp_path / "accelerator_cpu_quick.json").read_text())
    assert results["backend"] == "cpu" and results["pallas_mode"] == "interpret"
    rows = {(r["op"], r["kind"]): r for r in results["rows"]}
    assert set(rows) == {
        ("linear", "fwd+bwd"),
        ("mul_constant", "fwd+bwd"),
        ("rms_norm", "fwd+bwd"),
        ("rms_norm", "fwd"),
    }
    for (op, _), row in rows.items():
        # Each contender computed what plain XLA computes (float32, small sums).
        assert row["max_rel_err_vs_plain"] < 1e-4, row
        assert row["ratio"]["median"] > 0
        # Interpret-mode Pallas rows are labelled and never reported as kernel timings.
        assert row["kernel_timing"] == (op != "rms_norm")
        assert (row["label"] == "interpret mode") == (op == "rms_norm")
        assert row.get("implementation") == ("interpret" if op == "rms_norm" else None)
    table = (tmp_path / "accelerator_cpu_quick.md").read_text()
    assert "interpret mode" in table and "not kernel timings" in table
