"""The benchmarks against peers that are repositories, not packages (bench.nanogpt, bench.gptfast):
their command lines and tables (the q/k row permutation bench.gptfast loads with is
positions.convert_rope_layout, tested in test_positions). The peers themselves are
not here (they live outside the repository), so the timed runs are not part of the tests."""

from __future__ import annotations

import pytest

from bench import gptfast, nanogpt

MACHINE = dict(nproc=2, cpu="cpu", torch="t", torch_threads=1, commit="c", load_avg_1m=1.0)


@pytest.mark.parametrize("module, flag", [(nanogpt, "--nanogpt"), (gptfast, "--gpt-fast")])
def test_a_folder_without_the_peer_is_named(module, flag, tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        module.main([flag, str(tmp_path), "--no-doc"])
    assert exc.value.code == 2
    assert str(tmp_path) in capsys.readouterr().err


def test_nanogpt_table_has_ratios_routes_and_mfu():
    times = {"logitlab": [1.0, 1.1, 0.9], "nanogpt": [1.5, 1.4, 1.6], "nanogpt-fused": [1.2, 1.3, 1.2]}
    row = dict(shape="gpt2-small", dtype="bf16", B=4, T=256, times=times, route="native",
               first_s={s: 10.0 for s in times}, mfu={s: 0.25 for s in times},
               **{f"{s}_ratio": {"median": 1.5, "min": 1.4, "max": 1.6} for s in ("nanogpt", "nanogpt-fused")})
    text = nanogpt.render(dict(command="python3 -m bench.nanogpt --no-doc", machine=MACHINE, cpu_flags=["amx_bf16"],
                               matmul_flops_per_s={"fp32": 1e11, "bf16": 2e11}, repeats=3, clock="cpu",
                               sides=list(times), keep_freed_memory=False, rows=[row]))
    assert "| gpt2-small | bf16 | 4 x 256 | native | 900 | 1,400 | 1,200 | **1.50** (1.40-1.60) |" in text
    assert "25% / 25% / 25%" in text and "amx_bf16" in text and "glibc's defaults" in text


def test_gptfast_table_reads_cold_and_warm_runs():
    def runs(rate, first):
        cold = [dict(tok_s=[rate, rate * 0.9], first_s=first, tokens=[1, 2], cache="cold") for _ in range(2)]
        return cold + [dict(tok_s=[rate], first_s=1.0, tokens=[1, 2], cache="warm")]
    got = {"logitlab": runs(400.0, 30.0), "gpt-fast": runs(200.0, 20.0), "gpt-fast tuned": runs(320.0, 40.0),
           "logitlab eager": [dict(tok_s=[150.0], first_s=0.1, tokens=[1, 2])],
           "gpt-fast eager": [dict(tok_s=[100.0], first_s=0.1, tokens=[1, 3])]}
    point = dict(dtype="fp32", runs=got, same_tokens={s: s != "gpt-fast eager" for s in got})
    text = gptfast.render(dict(command="python3 -m bench.gptfast", machine=MACHINE, cpu_flags=[], shape=gptfast.SHAPE,
                               compiles=2, repeats=2, new_tokens=8, points=[point]))
    assert "| fp32 | 2.00 | 1.25 | 1.50 | 1.50 |" in text       # vs its options, equal options, eager, first call
    assert "| fp32 | logitlab | 400 / 400 | 400 | 1.00 | 30.0 / 30.0 | 1.0 | yes | - |" in text
    assert "| fp32 | gpt-fast eager | 100 | - | - | - | - | no | - |" in text


def test_autotune_picks_compare_between_compiles():
    def run(*picks):
        return dict(autotune_picks=[{"op": f"mm {i}", "pick": p, "ms": {p: 0.1}} for i, p in enumerate(picks)])
    assert gptfast.same_picks([run("cpp", "aten"), run("cpp", "aten"), dict(autotune_picks=[])]) == "yes (2 products)"
    assert gptfast.same_picks([run("cpp", "aten"), run("cpp", "cpp")]) == "no: 1 of 2 differ"
    assert gptfast.same_picks([run("cpp"), run("cpp", "aten")]) == "no: 1 of 2 differ"
    assert gptfast.same_picks([dict(tok_s=[1.0]), dict(autotune_picks=[])]) == "-"


def test_autotune_picks_are_heard_from_inductor(monkeypatch):
    import torch._inductor.select_algorithm as select

    heard = []
    monkeypatch.setattr(select, "add_feedback_saver", heard.append)

    class Choice:
        def __init__(self, name, description=""):
            self.name, self.description = name, description

    class Node:
        def get_size(self):
            return [1, 384]

    picks = gptfast.autotune_picks()
    assert len(heard) == 1 and picks == []
    timings = {Choice("cpp_gemm_12", "block=(1,32)"): 0.02, Choice("aten_mm"): 0.05}
    heard[0](timings, "mm", [Node(), Node()], [], None, {})
    assert picks == [{"op": "mm (1, 384)x(1, 384)", "pick": "cpp_gemm (block=(1,32))",
                      "ms": {"cpp_gemm (block=(1,32))": 0.02, "aten_mm": 0.05}}]



def test_a_side_that_cannot_build_its_model_names_itself(tmp_path):
    from bench.model import SideProcess

    config, _, _ = nanogpt.POINTS["gpt2-6x384"]
    spec = dict(config=config.to_dict(), B=1, T=8, threads=1, nanogpt=str(tmp_path), directory=str(tmp_path),
                keep_freed_memory=False)
    with pytest.raises(RuntimeError, match="(?s)benchmark side 'nanogpt' failed.*No module named 'model'"):
        SideProcess("nanogpt", spec, nanogpt._serve)
