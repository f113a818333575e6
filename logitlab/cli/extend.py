"""Extending a trained run's context on a resume (`logitlab train --resume RUN --context-length N
--rope-scaling KIND[:FACTOR]`): the flag's parser, the run's model config made longer and scaled
(model.positions.extended_config), and the before/after line printed when the fine-tune ends.
The weights, optimizer state and the metrics record of the change are train.build's
(load_resume, record_extension); cli/train.py calls these from its resume path."""

from __future__ import annotations

from pathlib import Path

# With a longer --context-length (and --rope-scaling), a resume also may change the window length
# and the batch: the fine-tune at the new length is free to keep the tokens per step.
EXTEND_MAY_CHANGE = ("seq_len", "batch_size")


def parse_rope_scaling(text: str) -> tuple[str, float | None]:
    """--rope-scaling KIND[:FACTOR] -> (kind, factor or None): KIND one of none, linear, ntk,
    dynamic, yarn; FACTOR a number > 0 (default: new context length / the run's)."""
    from logitlab.model.positions import EXTENSIONS

    kind, _, factor = text.strip().partition(":")
    if kind not in EXTENSIONS:
        raise ValueError(f"--rope-scaling {text!r}: unknown kind {kind!r}; known: {', '.join(EXTENSIONS)} "
                         "(e.g. yarn:4)")
    if not factor:
        return kind, None
    try:
        value = float(factor)
    except ValueError:
        raise ValueError(f"--rope-scaling {text!r}: the factor {factor!r} is not a number") from None
    if not 0 < value < float("inf") or kind == "none":
        raise ValueError(f"--rope-scaling {text!r}: " + ("'none' takes no factor" if kind == "none" else
                                                        "the factor must be a finite number > 0"))
    return kind, value


def extend_run(args, run: dict) -> bool:
    """A resume with --context-length longer than the run's: run["model"] becomes the extended
    model (positions.extended_config; --rope-scaling KIND[:FACTOR], default none), run["train"]'s
    seq_len follows the new context unless --seq-len is given. -> whether the run is extended.
    --rope-scaling without a longer context must match the run's own scaling (a repeated resume)."""
    from logitlab.model.positions import extended_config
    from logitlab.model.transformer import ModelConfig

    spec = getattr(args, "rope_scaling_spec", None)
    kind, factor = parse_rope_scaling(spec) if spec else ("none", None)
    old, new = run["model"].get("context_length"), getattr(args, "context_length", None)
    if new is None or new == old:
        have = run["model"].get("rope_scaling") or {}
        same = (kind == "none" and not have) or (
            have.get("rope_type") == kind and (factor is None or have.get("factor") == factor))
        if spec and not same:
            raise ValueError(f"--rope-scaling {spec} changes the model: give a --context-length longer than the "
                             f"run's {old} with it (the run has rope_scaling {have or None})")
        return False
    if new < old:
        raise ValueError(f"--context-length {new}: a resumed run may lengthen its context ({old}), not shorten it")
    extended = extended_config(ModelConfig.from_dict(run["model"]), new, kind, factor)
    run["model"] = extended.to_dict()
    if not hasattr(args, "seq_len"):
        run["train"] = {**run["train"], "seq_len": None}
    return True


def show_extension(run_dir: Path, con, result) -> None:
    """After a resume that extended the model: validation loss before, right after and after the
    fine-tune (the metrics record train.build.record_extension wrote)."""
    import json

    path = run_dir / "metrics.jsonl"
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.is_file() else []
    ext = [r for r in records if "extended" in r]
    if not ext or ext[-1]["step"] >= result.step:
        return
    r = ext[-1]

    def shown(key: str, value) -> str:
        if key == "rope_scaling":
            return f"{value['rope_type']}:{value['factor']:g}" if value else "none"
        return str(value)

    change = ", ".join(f"{k} {shown(k, a)} -> {shown(k, b)}" for k, (a, b) in r["extended"].items())

    def fmt(value) -> str:
        return "n/a" if value is None else f"{value:.4f}"

    con.print(f"extended at step {r['step']} ({change}): val loss {fmt(r.get('val_loss_before'))} before, "
              f"{fmt(r.get('val_loss'))} at the new length untrained, {fmt(result.val_loss)} after "
              f"{result.step - r['step']} steps", markup=False)
