"""Muon: momentum orthogonalised by Newton-Schulz iterations for the hidden matrices, AdamW for
everything else, as one optimizer over parameter groups (MuonAdamW).

Muon (Jordan et al. 2024, "Muon: an optimizer for hidden layers in neural networks") keeps
SGD's Nesterov momentum M for a weight matrix W and steps along the momentum's polar factor:
if M = U S V^T (its SVD), the update is U V^T, every singular value set to 1. A step then moves
W by the same amount in every direction the gradient points to, instead of mostly along the few
directions with the largest singular values (which is where Adam's and SGD's updates go).

muon.py owns
- `orthogonalize(G, steps, method)`: U V^T approximated by an odd matrix polynomial iterated
  `steps` times (Newton-Schulz), without any SVD: "quintic" uses one coefficient triple for every
  iteration, "polar_express" one per iteration; `polynomial_of_singular_values` is the same map
  applied to G's singular values through an SVD, the reference the tests compare against;
- `muon_update`: the momentum, then the orthogonalised update, one block of rows at a time (the
  fused q | k | v and gate | up projections are separate matrices), scaled by sqrt(max(1, rows / cols));
- `MuonAdamW`: one torch Optimizer whose groups are kind "muon" (2-D hidden matrices) or "adamw"
  (embeddings, the LM head, gains, biases: torch's own AdamW update, fused on CPU and CUDA); its
  state_dict is torch's, so checkpoints save and resume it exactly as they do AdamW;
- `row_blocks(model)`: the row blocks of the fused projections.

Under FSDP2 a matrix's gradient is a shard of rows (a DTensor): the update gathers the full
momentum (`full_tensor`), orthogonalises it on every rank and keeps this rank's rows, so a
sharded step computes exactly what one process computes (the momentum itself stays sharded).
Under DDP every rank holds the whole averaged gradient and computes the same update.

It imports nothing from logitlab (row_blocks reads the model's config and state-dict names).
"""

from __future__ import annotations

import math

import torch
from torch import nn

# The quintic of Jordan et al. (2024): p(s) = a s + b s^3 + c s^5, chosen for the steepest slope
# at 0 that still maps (0, 1] into about [0.7, 1.2] after five iterations: not exactly 1, which
# they found costs nothing in training, and small singular values grow fast.
QUINTIC = (3.4445, -4.7750, 2.0315)
# Polar Express (Amsel, Persson, Musco & Gower 2025, arXiv:2505.16932): a different quintic for
# each iteration, minimax-optimal for singular values in [1e-3, 1], which lands them much closer
# to 1 (their coefficients for five iterations, safety factor 2e-2, cushion 2).
POLAR_EXPRESS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
METHODS = ("quintic", "polar_express")
MUON_LR = 0.02  # the matrices' learning rate when none is given: spectral norm moved per step (Jordan et al.)


def coefficients(method: str, steps: int) -> list[tuple[float, float, float]]:
    """The (a, b, c) of each of `steps` iterations; Polar Express repeats its last triple."""
    if method == "quintic":
        return [QUINTIC] * steps
    if method == "polar_express":
        return [POLAR_EXPRESS[min(i, len(POLAR_EXPRESS) - 1)] for i in range(steps)]
    raise ValueError(f"orthogonalization method must be one of {METHODS}, got {method!r}")


def _scale(G: torch.Tensor, method: str) -> torch.Tensor:
    """G / ||G||_F: every singular value in [0, 1] (the Frobenius norm bounds the spectral one);
    Polar Express divides by 1.01 more, the margin its coefficients were derived for."""
    norm = torch.linalg.matrix_norm(G)
    return G / (norm * 1.01 + 1e-6) if method == "polar_express" else G / (norm + 1e-7)


def orthogonalize(G: torch.Tensor, steps: int = 5, method: str = "quintic") -> torch.Tensor:
    """An approximation of U V^T for G (m, n) = U S V^T, in float32, without an SVD.

    X = G / ||G||_F, then `steps` times X <- a X + (b A + c A^2) X with A = X X^T: an odd
    polynomial of X, so X keeps G's singular vectors and each singular value s goes to
    a s + b s^3 + c s^5. A tall G is transposed first so that A is the smaller Gram matrix."""
    if G.ndim != 2:
        raise ValueError(f"orthogonalize needs a matrix, got shape {tuple(G.shape)}")
    tall = G.shape[0] > G.shape[1]
    X = _scale(G.float(), method)
    if tall:
        X = X.T                                                  # (n, m): rows <= columns
    for a, b, c in coefficients(method, steps):
        A = X @ X.T                                              # (rows, rows)
        X = a * X + (b * A + c * (A @ A)) @ X
    return X.T if tall else X


def polynomial_of_singular_values(G: torch.Tensor, steps: int = 5, method: str = "quintic") -> torch.Tensor:
    """The reference for `orthogonalize`: U diag(p(s)) V^T in float64, p the same iteration applied
    to each scaled singular value s of G through torch.linalg.svd."""
    G = G.double()
    U, S, Vh = torch.linalg.svd(G, full_matrices=False)        # (m, k), (k,), (k, n)
    s = S / (S.square().sum().sqrt() * (1.01 if method == "polar_express" else 1.0))
    for a, b, c in coefficients(method, steps):
        s = a * s + b * s**3 + c * s**5
    return U @ torch.diag(s) @ Vh


def _gathered(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of an FSDP2 shard (a DTensor), or t itself."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _sharded_like(full: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """`full` laid out as `like` (this rank's rows of a DTensor; every rank holds the same
    `full`, so no data moves), or `full` itself for a plain tensor."""
    if not hasattr(like, "device_mesh"):
        return full
    from torch.distributed.tensor import distribute_tensor

    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


def muon_update(grad: torch.Tensor, momentum_buffer: torch.Tensor, *, momentum: float = 0.95,
                nesterov: bool = True, steps: int = 5, method: str = "quintic",
                blocks: tuple[int, ...] | None = None) -> torch.Tensor:
    """The update of one matrix (rows, cols) of gradient `grad`; advances `momentum_buffer`.

    M <- momentum * M + (1 - momentum) * grad; the direction is grad + momentum * (M - grad)
    (Nesterov) or M; each block of rows (`blocks`, summing to rows; default the whole matrix)
    is orthogonalised apart and scaled by sqrt(max(1, block_rows / cols)), so a tall block moves
    its columns by as much as a square one does (Jordan et al.)."""
    momentum_buffer.lerp_(grad, 1 - momentum)
    direction = grad.lerp(momentum_buffer, momentum) if nesterov else momentum_buffer
    full = _gathered(direction)                                  # (rows, cols)
    cols = full.shape[1]
    parts = full.split(list(blocks)) if blocks else (full,)
    update = torch.cat([orthogonalize(part, steps, method) * math.sqrt(max(1.0, part.shape[0] / cols))
                        for part in parts])
    return _sharded_like(update.to(grad.dtype), grad)


def row_blocks(model: nn.Module) -> dict[str, tuple[int, ...]]:
    """{parameter name: row blocks} for the fused projections, whose blocks are separate matrices
    (transformer.py's state-dict keys): attention's q | k | v, SwiGLU's gate | up, and Gated
    DeltaNet's q | k | v input projection."""
    c = getattr(model, "config", None)
    if c is None:
        return {}
    by_suffix = {"attn.qkv_proj.weight": (c.n_heads * c.head_dim, c.n_kv_heads * c.head_dim,
                                          c.n_kv_heads * c.head_dim),
                 "mlp.gate_up_proj.weight": (c.d_ff, c.d_ff),
                 "linear_attn.in_proj_qkv.weight": (c.linear_n_k_heads * c.linear_k_head_dim,
                                                    c.linear_n_k_heads * c.linear_k_head_dim,
                                                    c.linear_n_v_heads * c.linear_v_head_dim)}
    out = {}
    for name, p in model.named_parameters():
        for suffix, blocks in by_suffix.items():
            if name.endswith(suffix) and sum(blocks) == p.shape[0]:
                out[name] = blocks
    return out


class MuonAdamW(torch.optim.Optimizer):
    """Muon for the groups of kind "muon", AdamW for those of kind "adamw", in one optimizer.

    A "muon" group holds 2-D parameters and the keys lr, weight_decay, momentum, nesterov,
    ns_steps, ns_method and blocks (one entry per parameter: its row blocks, or None). Its step:
    W <- W * (1 - lr * weight_decay) - lr * muon_update(grad, M). An "adamw" group holds the keys
    of torch.optim.AdamW (lr, betas, eps, weight_decay) and steps with torch's AdamW, fused on CPU
    and CUDA (`fused`, as optim.build_adamw decides). Any group may carry lr_scale, its rate as a
    multiple of the schedule's (optim.WarmupCosine.apply)."""

    def __init__(self, groups: list[dict], *, betas=(0.9, 0.95), eps: float = 1e-8, fused: bool | None = None):
        for g in groups:
            if g.get("kind") not in ("muon", "adamw"):
                raise ValueError(f"every MuonAdamW group needs kind 'muon' or 'adamw', got {g.get('kind')!r}")
            if g["kind"] == "muon":
                bad = [tuple(p.shape) for p in g["params"] if p.ndim != 2]
                if bad:
                    raise ValueError(f"Muon updates matrices; a muon group holds parameters of shape {bad}")
                g.setdefault("blocks", [None] * len(g["params"]))
                coefficients(g.setdefault("ns_method", "quintic"), 1)   # an unknown method is named here
        if fused is None:
            fused = all(p.device.type in ("cpu", "cuda") for g in groups for p in g["params"])
        defaults = dict(lr=0.02, weight_decay=0.0, momentum=0.95, nesterov=True, ns_steps=5, ns_method="quintic",
                        betas=tuple(betas), eps=eps, fused=fused)
        super().__init__(groups, defaults)

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        for group in self.param_groups:
            if group["kind"] == "muon":
                self._muon_step(group)
            else:
                self._adamw_step(group)
        return loss

    def _muon_step(self, group: dict) -> None:
        for p, blocks in zip(group["params"], group["blocks"]):
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["momentum_buffer"] = torch.zeros_like(p)
            update = muon_update(p.grad, state["momentum_buffer"], momentum=group["momentum"],
                                 nesterov=group["nesterov"], steps=group["ns_steps"], method=group["ns_method"],
                                 blocks=tuple(blocks) if blocks else None)
            if group["weight_decay"]:
                p.mul_(1 - group["lr"] * group["weight_decay"])
            p.add_(update, alpha=-group["lr"])

    def _adamw_step(self, group: dict) -> None:
        """torch's AdamW update (decoupled weight decay) over this group, with the state layout
        of torch.optim.AdamW (step, exp_avg, exp_avg_sq)."""
        from torch.optim.adam import adam

        params, grads, exp_avgs, exp_avg_sqs, steps = [], [], [], [], []
        fused = bool(group["fused"])
        for p in group["params"]:
            if p.grad is None:
                continue
            state = self.state[p]
            if not state:
                state["step"] = (torch.zeros((), dtype=torch.float32, device=p.device) if fused
                                 else torch.tensor(0.0, dtype=torch.float32))
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            params.append(p)
            grads.append(p.grad)
            exp_avgs.append(state["exp_avg"])
            exp_avg_sqs.append(state["exp_avg_sq"])
            steps.append(state["step"])
        if not params:
            return
        beta1, beta2 = group["betas"]
        adam(params, grads, exp_avgs, exp_avg_sqs, [], steps, foreach=None if fused else True, fused=fused,
             decoupled_weight_decay=True, amsgrad=False, beta1=beta1, beta2=beta2, lr=group["lr"],
             weight_decay=group["weight_decay"], eps=group["eps"], maximize=False)
