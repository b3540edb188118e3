"""The measurement scripts in scripts/ import the trainlib of their own
checkout: on the GPU machine trainlib is not installed (its torch cannot be
replaced; the source tree is used as is), and where some other trainlib is
installed a script must still measure the tree it sits in."""

import json
import os
import re
import shutil
import subprocess
import sys

from tests.helpers import REPO

# guard_overhead.py takes trainlib from PYTHONPATH on purpose: it also measures older trees.
SCRIPTS = sorted(p.name for p in (REPO / "scripts").glob("*.py") if p.name != "guard_overhead.py"
                 and re.search(r"^(from|import) trainlib\b", p.read_text(), re.M))


def test_scripts_import_the_trainlib_of_their_checkout(tmp_path):
    assert {"benchmark.py", "ac_memory.py", "cp_memory.py"} <= set(SCRIPTS)
    checkout = tmp_path / "checkout"
    (checkout / "trainlib").mkdir(parents=True)
    (checkout / "scripts").mkdir()
    # A stand-in package: importing it says so and stops the script there.
    (checkout / "trainlib" / "__init__.py").write_text("import sys\nprint('checkout trainlib')\nsys.exit(17)\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    for name in SCRIPTS:
        shutil.copy(REPO / "scripts" / name, checkout / "scripts" / name)
        proc = subprocess.run([sys.executable, str(checkout / "scripts" / name), "--help"], cwd=tmp_path,
                              capture_output=True, text=True, env=env, timeout=300, check=False)
        assert (proc.returncode, proc.stdout.strip()) == (17, "checkout trainlib"), (name, proc.stderr[-2000:])


def test_trace_kernels_sums_the_last_gpu_step_by_kind(tmp_path, capsys):
    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import trace_kernels
    finally:
        sys.path.remove(str(REPO / "scripts"))

    def kernel(name, ts, dur):
        return {"cat": "kernel", "name": name, "ts": ts, "dur": dur}

    adam = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
            "FusedOptimizerTensorListMetadata<4>, at::native::(anonymous namespace)::FusedAdamMathFunctor<float, 4>>")
    norm = ("void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::"
            "TensorListMetadata<1>, at::native::LpNormFunctor<float, (at::native::NormType)1, float, 1, 1, 0>>")
    events = [
        {"cat": "user_annotation", "name": "ProfilerStep#19", "ts": 0, "dur": 5000},  # the host side: not the window
        {"cat": "gpu_user_annotation", "name": "ProfilerStep#18", "ts": 0, "dur": 900},
        {"cat": "gpu_user_annotation", "name": "ProfilerStep#19", "ts": 1000, "dur": 1000},
        kernel("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 500, 400),  # the step before
        kernel("nvjet_sm90_tst_256x128_64x4_1x2_h_bz_coopA_NNT", 1000, 300),
        kernel("nvjet_sm90_tst_128x256_64x4_2x1_h_bz_coopB_TNT", 1300, 20),
        kernel("cudnn_generated_fort_native_sdpa_sm90_flash_bprop_wgmma_f16_knob_7", 1400, 150),
        kernel(adam, 1600, 200), kernel(norm, 1800, 60), kernel(norm, 1860, 40),
        kernel("triton_poi_fused__to_copy_3", 1900, 30),
        kernel("triton_poi_fused_scaled_dot_product_cudnn_attention_backward_to_copy_1", 1930, 20),
        kernel("void at::native::vectorized_elementwise_kernel<4, at::native::FillFunctor<float>>", 1950, 10),
        kernel("triton_poi_fused__to_copy_9", 2000, 999),  # the next step
    ]
    s = trace_kernels.summarize(events)
    assert (s["window"], s["window_us"], s["busy_us"]) == ("ProfilerStep#19", 1000, 830)
    assert dict(s["by_kind"]) == {"gemm": 320, "attention": 150, "optimizer (fused AdamW)": 200,
                                  "multi-tensor (foreach: norm, clip, ...)": 100, "triton (inductor)": 50, "other": 10}
    assert s["count"]["multi_tensor_apply LpNormFunctor"] == 2 and s["by_name"]["multi_tensor_apply LpNormFunctor"] == 100
    assert trace_kernels.summarize(events[3:])["busy_us"] == 400 + 830 + 999  # no GPU annotation: all of it
    path = tmp_path / "trace.json"
    path.write_text(json.dumps({"traceEvents": events}))
    assert trace_kernels.main([str(path), "--top", "3"]) == 0
    out = capsys.readouterr().out
    assert "ProfilerStep#19: 1.00 ms on the GPU, kernels busy 0.83 ms" in out
    assert "    0.32 ms  gemm" in out and len(out.strip().split("\n\n")[1].splitlines()) == 3
