"""The live view of a training run (cli/train.py, cli/demo.py): a line per evaluation, and in a
terminal a rich progress bar below them with step, loss, validation loss, tokens/s and time left."""

from __future__ import annotations


class LiveProgress:
    """The train callback: a line per evaluation, kept on screen, and when the console is
    interactive a rich progress bar (step, loss, val, tok/s, ETA) under them."""

    def __init__(self, con, enabled: bool) -> None:
        self.con, self.enabled, self.bar, self.task = con, enabled and con.is_terminal, None, None
        self.quiet = not enabled

    def __call__(self, event: str, r: dict) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        if event == "start":
            if not self.quiet:
                self.con.print(f"training on {r['device']} ({_precision(r['amp'])}), "
                               f"{r['tokens_per_step']:,} tokens/step -> {r['run_dir']}")
                if r.get("bf16_route") is not None:
                    self.con.print(bf16_routes(r))
            if self.enabled:
                self.bar = Progress(TextColumn("step"), MofNCompleteColumn(), BarColumn(bar_width=30),
                                    TextColumn("loss {task.fields[loss]}  val {task.fields[val]}  "
                                               "{task.fields[tps]} tok/s{task.fields[moe]}"), TimeRemainingColumn(),
                                    console=self.con)
                self.bar.start()
                self.task = self.bar.add_task("train", total=r["steps"], completed=r["step"],
                                              loss="-", val="-", tps="-", moe="")
        elif event == "step" and self.bar is not None:
            fields = dict(loss=f"{r['loss']:.3f}", tps=f"{r['tokens_per_s']:,.0f}", moe=routing(r, short=True))
            if "val_loss" in r:
                fields["val"] = f"{r['val_loss']:.3f}"
            self.bar.update(self.task, completed=r["step"], **fields)
        elif event == "eval" and r["step"] == 0 and not self.quiet:
            self.con.print(f"step 0: val {r['val_loss']:.4f} (ppl {r['val_ppl']:.1f})")
            if self.bar is not None:
                self.bar.update(self.task, val=f"{r['val_loss']:.3f}")
        elif event == "eval" and not self.quiet:
            # with a live bar, rich prints the line above it: every evaluation stays on screen
            self.con.print(f"step {r['step']}: loss {r['loss']:.4f}, val {r['val_loss']:.4f} "
                           f"(ppl {r['val_ppl']:.1f}), {r['tokens_per_s']:,.0f} tok/s{routing(r)}")
            if self.bar is not None:
                self.bar.update(self.task, val=f"{r['val_loss']:.3f}")
        elif event == "end":
            self.close()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None


def routing(r: dict, short: bool = False) -> str:
    """An MoE step record's routing (train.moe.RoutingLog) as a suffix: the balancing loss, the
    router's entropy and the busiest expert's share of its layer's assignments; "" for a dense model."""
    if "aux_loss" not in r:
        return ""
    busiest = max(max(row) for row in r["expert_share"])
    if short:
        return f"  aux {r['aux_loss']:.2f}  busiest expert {busiest:.0%}"
    dropped = f", {r['dropped']:.1%} dropped" if r.get("dropped") else ""
    return (f"; balancing loss {r['aux_loss']:.3f}, router entropy {r['router_entropy']:.2f} nats, busiest expert "
            f"{busiest:.0%} of its layer's assignments{dropped}")


def bf16_routes(r: dict) -> str:
    """The CPU bf16 routes of a start record (kernels.cpu_bf16.Installed.record) as one line:
    which kernels the products and attention run on, and the times that decided it."""
    def part(name: str, route: str, timings: dict | None) -> str:
        how = "float32 kernels" if route == "fp32" else "bf16 kernels"
        if timings:
            how += f" (measured: float32 {1e3 * timings['fp32']:,.1f} ms, bf16 {1e3 * timings['native']:,.1f} ms)"
        return f"{name} on {how}"
    parts = [part("products", r["bf16_route"], r.get("bf16_route_timings_s"))]
    if r.get("bf16_attention_route") is not None:
        parts.append(part("attention", r["bf16_attention_route"], r.get("bf16_attention_timings_s")))
    return "bf16 on the CPU: " + "; ".join(parts)


def _precision(amp: str) -> str:
    """The start event's autocast dtype as a reader says it: 'fp32', or 'bf16 autocast'."""
    return "fp32" if amp in (None, "None") else f"{amp.removeprefix('torch.').replace('bfloat16', 'bf16')} autocast"
