"""Training a mixture of experts: the router's losses, what the run logs about the routing, and the
auxiliary-loss-free balancing of DeepSeek-style routers.

train/moe.py owns:
- `load_balancing_loss` (Switch Transformer, Fedus et al. 2021, eqs. 4-6; the form Mixtral and
  Qwen-MoE train with): E * sum_i f_i * P_i, f_i the share of the N*K assignments that went to
  expert i, P_i the mean router probability of expert i. It is E * (1/E * 1/E) * E = 1 at perfect
  balance and E when every token goes to one expert (K = 1). Computed per MoE layer and averaged
  over them, so that every layer must balance; pooled=True pools the layers first, which is
  transformers' load_balancing_loss_func exactly (tests/test_moe_train.py checks both);
- `router_z_loss` (ST-MoE, Zoph et al. 2022): the mean of logsumexp(logits)^2, which keeps the
  router's logits small (a softmax in float32 stays accurate);
- `RouterLoss`, the training step's loss for an MoE model: cross-entropy + router_aux_loss_coef *
  balance + router_z_loss_coef * z, with the parts of its last call kept for the log;
- `RoutingLog`: the micro-steps' parts summed into one metrics record (ce_loss, aux_loss, z_loss,
  router_entropy, expert_share per layer, dropped share), and the correction-bias update.
- `update_correction_bias` (Wang et al. 2024, used by DeepSeek-V3): after each optimizer step,
  b_i += rate * sign(mean load - load_i) for each sigmoid_topk router, moving the selection toward
  underloaded experts without a loss term. Under data parallelism each rank counts its own tokens
  and DDP broadcasts rank 0's buffers at the next forward.

Shapes: N tokens of a layer's call, E experts, K experts per token, L_moe MoE layers.
"""

from __future__ import annotations

import torch

from logitlab.train.loss import cross_entropy


def routing_stats(records: list[dict], n_experts: int, mask: torch.Tensor | None = None):
    """What the balancing loss reads from the MoE layers of `records`: (counts (L_moe, E) the
    assignments per expert, detached; probs (L_moe, E) the summed router probabilities, with their
    gradient; rows (L_moe,) the tokens counted). mask (N,) float or None leaves padded tokens out."""
    layers = [r for r in records if "router_logits" in r]
    if not layers:
        raise ValueError("no MoE layer recorded its routing: is the model a mixture of experts?")
    counts, probs, rows = [], [], []
    for r in layers:
        logits, experts = r["router_logits"], r["experts"]                 # (N, E), (N, K)
        weight = torch.ones(experts.shape[0], device=logits.device) if mask is None else mask.float()
        counts.append(torch.zeros(n_experts, device=logits.device).scatter_add_(
            0, experts.reshape(-1), weight.repeat_interleave(experts.shape[-1])))   # (E,)
        probs.append((torch.softmax(logits.float(), dim=-1) * weight[:, None]).sum(0))  # (E,)
        rows.append(weight.sum())
    return torch.stack(counts).detach(), torch.stack(probs), torch.stack(rows).detach()


def sum_stats(counts: torch.Tensor, rows: torch.Tensor, reduce) -> tuple:
    """(counts, rows, R): the counts and rows summed over the ranks by `reduce` (a tensor -> its
    sum over the data-parallel ranks, one collective for both) and R the number of ranks; as
    they are, with R = 1, when reduce is None."""
    if reduce is None:
        return counts, rows, 1.0
    E = counts.shape[-1]
    packed = torch.cat([counts, rows[:, None], torch.ones_like(rows)[:, None]], dim=1).double()
    packed = reduce(packed)                                                # (L_moe, E + 2)
    return packed[:, :E].to(counts.dtype), packed[:, E].to(rows.dtype), float(packed[0, E + 1])


def balance_loss(counts, probs, rows, n_experts: int, pooled: bool = False, ranks: float = 1.0) -> torch.Tensor:
    """E * sum_i f_i P_i from routing_stats' parts: f the share of assignments per expert, P the
    mean router probability, per layer then averaged (or, pooled, over all layers at once).

    With data parallelism, counts and rows are those of the global batch (sum_stats) while probs
    are this rank's, and P is this rank's part of the global mean times the number of ranks R:
    the mean over ranks of this rank's loss is then the loss of the global batch, and so is the
    mean of their gradients (f carries none), as in one process."""
    if pooled:
        counts, probs, rows = counts.sum(0, keepdim=True), probs.sum(0, keepdim=True), rows.sum(0, keepdim=True)
    f = counts / rows[:, None]                                             # (L, E) share of assignments
    P = ranks * probs / rows[:, None]                                      # (L, E) mean router probability
    return (n_experts * (f * P).sum(-1)).mean()


def load_balancing_loss(records: list[dict], n_experts: int, attention_mask: torch.Tensor | None = None,
                        pooled: bool = False, reduce=None) -> torch.Tensor:
    """The Switch load-balancing loss of the MoE layers in `records` (Transformer.forward's records:
    router_logits (N, E), experts (N, K) per layer). attention_mask (B, T) with B * T = N: padded
    tokens (False / 0) left out. The mean over layers of E * sum_i f_i P_i, or (pooled) the layers'
    f and P summed first, as transformers' load_balancing_loss_func computes it. reduce: a
    tensor -> its sum over the data-parallel ranks (sum_stats, balance_loss)."""
    mask = None if attention_mask is None else attention_mask.reshape(-1)
    counts, probs, rows = routing_stats(records, n_experts, mask)
    counts, rows, R = sum_stats(counts, rows, reduce)
    return balance_loss(counts, probs, rows, n_experts, pooled, R)


def router_z_loss(records: list[dict]) -> torch.Tensor:
    """ST-MoE's z-loss: mean over tokens of logsumexp(router logits)^2, averaged over MoE layers."""
    layers = [r["router_logits"].float() for r in records if "router_logits" in r]
    return torch.stack([torch.logsumexp(z, dim=-1).square().mean() for z in layers]).mean()


def router_entropy(records: list[dict]) -> torch.Tensor:
    """Mean entropy (nats) of each token's router distribution softmax(logits), over MoE layers:
    ln E when a router cannot tell experts apart, 0 when it is certain."""
    layers = [torch.log_softmax(r["router_logits"].float(), dim=-1) for r in records if "router_logits" in r]
    return torch.stack([-(lp.exp() * lp).sum(-1).mean() for lp in layers]).mean()


def expert_load(records: list[dict], n_experts: int) -> torch.Tensor:
    """Assignments per expert, (L_moe, E) float, counted from the routers' choices (before capacity)."""
    return torch.stack([torch.bincount(r["experts"].reshape(-1), minlength=n_experts).float()
                        for r in records if "experts" in r])


class RouterLoss:
    """loss(ids, targets) for an MoE model: cross_entropy(model(ids), targets) + router_aux_loss_coef
    * load_balancing_loss + router_z_loss_coef * router_z_loss (the coefficients are the model's
    config). `last` holds the detached parts of the latest call: ce_loss, aux_loss, z_loss,
    router_entropy, load (L_moe, E) and dropped. compile: as train.loss.loss_fn (the grouped
    dispatch reads the expert counts on the host, so the graph breaks there: never fullgraph).
    reduce: a tensor -> its sum over the data-parallel ranks, for the balancing loss of the
    global batch (balance_loss) and the global load; it runs outside the compiled part."""

    def __init__(self, model, config, compile: bool | str = False, reduce=None):
        self.model, self.config, self.reduce, self.last = model, config, reduce, None
        self._parts = self._compute
        if compile:
            self._parts = torch.compile(self._compute, backend=compile if isinstance(compile, str) else "inductor")

    def _compute(self, ids: torch.Tensor, targets: torch.Tensor):
        records: list[dict] = []
        ce = cross_entropy(self.model(ids, records=records), targets)
        counts, probs, rows = routing_stats(records, self.config.n_experts)
        z = router_z_loss(records)
        with torch.no_grad():
            dropped = torch.stack([r["dropped"] for r in records if "dropped" in r]).mean()
            entropy = router_entropy(records)
        return ce, z, counts, probs, rows, entropy, dropped

    def __call__(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        c = self.config
        ce, z, counts, probs, rows, entropy, dropped = self._parts(ids, targets)
        total, rows_all, R = sum_stats(counts, rows, self.reduce)            # over the global batch
        aux = balance_loss(total, probs, rows_all, c.n_experts, ranks=R)
        loss = ce + c.router_aux_loss_coef * aux + c.router_z_loss_coef * z
        self.last = {k: v.detach() for k, v in dict(ce_loss=ce, aux_loss=aux, z_loss=z, router_entropy=entropy,
                                                    load=total, dropped=dropped).items()}
        return loss


@torch.no_grad()
def update_correction_bias(model, load: torch.Tensor, rate: float) -> int:
    """The auxiliary-loss-free balancing step: for MoE layer j of `model` with a correction bias,
    b_i += rate * sign(mean_i load[j] - load[j, i]). load (L_moe, E): the step's assignments per
    expert, in the order of the model's MoE layers. -> the number of routers updated."""
    from logitlab.model.moe import MoE

    layers = [m for m in model.modules() if isinstance(m, MoE)]
    if len(layers) != load.shape[0]:
        raise ValueError(f"load has {load.shape[0]} rows but the model has {len(layers)} MoE layers")
    updated = 0
    for moe, row in zip(layers, load):
        bias = moe.router.correction_bias
        if bias is not None and rate > 0:
            bias.add_(rate * torch.sign(row.mean() - row).to(bias))
            updated += 1
    return updated


class RoutingLog:
    """What one optimizer step's micro-steps say about the routing: add(parts) after each
    micro-step (RouterLoss.last), then after the optimizer step `step(model)` applies the
    correction-bias update (bias_rate > 0) and returns the metrics record's fields: the parts
    averaged over micro-steps, expert_share (L_moe lists of E shares of the step's assignments)."""

    def __init__(self, bias_rate: float = 0.0):
        self.bias_rate, self._sums, self._n = bias_rate, {}, 0

    def add(self, parts: dict | None) -> None:
        if parts is None:
            return
        for key, value in parts.items():
            self._sums[key] = self._sums[key] + value if key in self._sums else value.clone()
        self._n += 1

    def step(self, model) -> dict:
        if not self._n:
            return {}
        sums, n = self._sums, self._n
        self._sums, self._n = {}, 0
        load = sums.pop("load")                                            # (L_moe, E), summed
        if self.bias_rate > 0:
            update_correction_bias(model, load, self.bias_rate)
        share = load / load.sum(-1, keepdim=True)
        out = {key: float(value) / n for key, value in sums.items()}
        out["expert_share"] = [[round(float(s), 4) for s in row] for row in share]
        return out
