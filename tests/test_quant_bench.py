"""bench/bench_quant.py --smoke runs on the CPU and reports every row (the GPU run is the coordinator's)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))


def test_bench_quant_smoke(tmp_path):
    import bench_quant

    rows = {r["name"]: r for r in bench_quant.main(["--smoke", "--out", str(tmp_path)])}
    assert (tmp_path / "bench_quant.json").is_file()
    errors = {n: r["error"] for n, r in rows.items() if "error" in r}
    assert errors == {"linear fp8 scaled_mm": "needs a CUDA GPU with fp8 (sm89+)"}
    assert rows["train f=1.0 fp8"]["block_bytes"] < rows["train f=1.0 bf16"]["block_bytes"]
    assert rows["linear fp8 dequant"]["max_rel_err"] < 0.1
