"""bench/speed/bench_quant.py --smoke runs on the CPU and reports every row (the GPU run is the coordinator's)."""


def test_bench_quant_smoke(tmp_path):
    from bench.speed import bench_quant

    rows = {r["name"]: r for r in bench_quant.main(["--smoke", "--out", str(tmp_path)])}
    assert (tmp_path / "bench_quant.json").is_file()
    errors = {n: r["error"] for n, r in rows.items() if "error" in r}
    assert errors == {"linear fp8 scaled_mm": "needs a CUDA GPU with fp8 (sm89+)"}
    assert rows["train f=1.0 fp8"]["block_bytes"] < rows["train f=1.0 bf16"]["block_bytes"]
    assert rows["train f=1.0 fp8+mod"]["block_bytes"] < rows["train f=1.0 fp8"]["block_bytes"]
    assert rows["sample f=1.0 fp8+mod"]["block_bytes"] == rows["train f=1.0 fp8+mod"]["block_bytes"]
    assert rows["linear fp8 dequant"]["max_rel_err"] < 0.1


def test_quant_block_error_smoke(tmp_path):
    """bench/diag/quant_block_error.py --smoke: every block and variant, and quantizing the modulation Linears moves
    only the modulation output (the bf16 and block-only variants leave it at the bf16 value)."""
    from bench.diag import quant_block_error

    rows = quant_block_error.main(["--smoke", "--out", str(tmp_path)])
    assert (tmp_path / "quant_block_error.json").is_file()
    assert len(rows) == 3 * len(quant_block_error.VARIANTS)
    by = {(r["block"], r["variant"]): r for r in rows}
    for block in ("flux double", "flux single", "qwen-image"):
        assert by[block, "bf16"]["update_vs_bf16"] == 0
        assert by[block, "fp8"]["modulation_vs_fp32"] == by[block, "bf16"]["modulation_vs_fp32"]
        assert by[block, "fp8+mod"]["modulation_vs_fp32"] != by[block, "fp8"]["modulation_vs_fp32"]
        assert by[block, "fp8+mod"]["linears"] > by[block, "fp8"]["linears"] > 0
