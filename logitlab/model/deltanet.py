"""Gated DeltaNet (Yang, Kautz & Hatamizadeh 2024): the linear-attention layer of Qwen3-Next and
Qwen3.5, as a token mixer beside attention.

Instead of keeping every past key and value, each head keeps one state matrix S (Dk, Dv) and
rewrites it at every position with the gated delta rule:

    S_t = a_t * (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T        o_t = S_t^T q_t

a_t = exp(g_t) in (0, 1] forgets a share of the whole state (the gate); the delta rule then
replaces what the state recalls for k_t, S^T k_t, by v_t at the learning rate beta_t in (0, 1)
(the error-correcting update of Widrow and Hoff). Memory per head is Dk x Dv whatever the length.

The rule comes in three forms that compute the same numbers (a test checks they agree):

- `gated_delta_rule_reference`: the loop over positions above, for teaching;
- `gated_delta_rule_step`: one position of it, for decoding with a cache;
- `gated_delta_rule_chunked`: the chunked parallel form for prefill and training. Inside a chunk
  of C positions the updates are solved at once (the UT transform of the WY representation);
  only the C x Dk x Dv state passes from chunk to chunk.

Shapes: B batch, T positions, D d_model, Hk query/key heads, Hv value heads (a multiple of Hk;
value head j reads key head j // (Hv // Hk)), Dk and Dv the head widths, K the conv kernel.
The state is float32 (B, Hv, Dk, Dv): S[b, h] maps a key to a value, as in the rule above.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from logitlab.model.hooks import tap
from logitlab.model.norms import GatedRMSNorm

# Positions per chunk of the chunked form, by device type. The results agree to rounding for any
# size; the size sets the balance between the C x C work inside a chunk (grows with C) and the
# number of steps of the loop over chunks (shrinks with C). Fixed per device type rather than
# timed at run time, so that a run gives the same bits every time (bit-exact resume).
# CPU: 16, measured fastest forward and backward on 2-core x86 (python3 -m bench.hybrid --part
# chunks prints the comparison on the machine that runs it). GPU: 64, fewer and larger launches.
CHUNK = {"cpu": 16}
CHUNK_DEFAULT = 64


def default_chunk(device: torch.device) -> int:
    """The chunk size gated_delta_rule_chunked uses on `device` when none is given."""
    return CHUNK.get(torch.device(device).type, CHUNK_DEFAULT)


def l2_normalise(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (q and k of each head)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def gated_delta_rule_reference(q, k, v, g, beta, state=None):
    """The rule as written, one position at a time: the obviously-correct form.

    q, k (B, T, H, Dk) (k L2-normalised; q normalised and scaled by 1/sqrt(Dk)), v (B, T, H, Dv),
    g (B, T, H) log-decay (<= 0), beta (B, T, H); state (B, H, Dk, Dv) or None (zeros).
    Returns (o (B, T, H, Dv), final state (B, H, Dk, Dv)), in float32."""
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    q, k, v, g, beta = (t.float() for t in (q, k, v, g, beta))
    S = torch.zeros(B, H, Dk, Dv, device=v.device) if state is None else state.float().clone()
    out = []
    for t in range(T):
        S = S * g[:, t].exp()[..., None, None]                            # forget: a_t S
        recalled = torch.einsum("bhk,bhkv->bhv", k[:, t], S)              # what S says for k_t
        delta = beta[:, t, :, None] * (v[:, t] - recalled)                # (B, H, Dv)
        S = S + torch.einsum("bhk,bhv->bhkv", k[:, t], delta)             # write the correction
        out.append(torch.einsum("bhk,bhkv->bhv", q[:, t], S))             # o_t = S^T q_t
    return torch.stack(out, dim=1), S


def gated_delta_rule_step(q, k, v, g, beta, state):
    """One position of the rule, updating `state` (B, H, Dk, Dv) float32 in place.

    q, k (B, H, Dk), v (B, H, Dv), g, beta (B, H). Returns o (B, H, Dv) float32."""
    state.mul_(g.float().exp()[..., None, None])
    k = k.float()
    recalled = torch.einsum("bhk,bhkv->bhv", k, state)
    delta = beta.float()[..., None] * (v.float() - recalled)
    state.add_(k[..., :, None] * delta[..., None, :])
    return torch.einsum("bhk,bhkv->bhv", q.float(), state)


def _blocks(t: torch.Tensor, pad: int, N: int, C: int) -> torch.Tensor:
    """(B, T, H, *) -> (B, H, N, C, *) float32 and contiguous, zero-padded to N*C positions: one
    copy (padding first, in the input's own layout, then the transposition)."""
    t = t.float()
    if pad:
        t = F.pad(t, (0, 0) * (t.dim() - 2) + (0, pad))
    B, _, H = t.shape[:3]
    return t.transpose(1, 2).contiguous().view(B, H, N, C, *t.shape[3:])


def gated_delta_rule_chunked(q, k, v, g, beta, state=None, chunk: int | None = None):
    """The same rule, C = `chunk` positions at a time. Arguments and result as the reference.

    In a chunk starting from state S0, let G_t = exp(g_1 + ... + g_t) (the decay so far) and
    A[t, s] = beta_t (k_t . k_s) G_t / G_s for s < t. The corrections u_t that the positions
    write (S_t = G_t S0 + sum_{s<=t} G_t / G_s k_s u_s^T) solve one triangular system,

        (I + A) U = beta V - (G beta K) S0     so     U = Y - (I + A)^-1 (G beta K) S0,
        with Y = (I + A)^-1 beta V,

    where Y and (I + A)^-1 do not depend on S0 and are solved for every chunk at once. Then
        O = G (Q S0) + (Q K^T * G_t / G_s, s <= t) U        and
        S_C = G_C S0 + (K G_C / G)^T U
    carry the state through the chunks, a few small products each. chunk: C (None: default_chunk)."""
    B, T, H, Dk = k.shape
    Dv = v.shape[-1]
    C = chunk or default_chunk(k.device)
    N = (T + C - 1) // C
    pad = N * C - T                            # padding has k = v = 0, beta = 0, g = 0: no effect
    q, k, v = (_blocks(t, pad, N, C) for t in (q, k, v))                  # (B, H, N, C, Dk|Dv)
    g, beta = (_blocks(t[..., None], pad, N, C)[..., 0] for t in (g, beta))   # (B, H, N, C)
    logG = g.cumsum(-1)                                                   # (B, H, N, C)
    ratio = logG[..., :, None] - logG[..., None, :]                       # log G_t / G_s (B, H, N, C, C)
    lower = torch.ones(C, C, dtype=torch.bool, device=k.device).tril()
    decay = ratio.masked_fill(~lower, float("-inf")).exp()                # G_t / G_s for s <= t, else 0
    kb = k * beta[..., None]                                              # beta_t k_t
    eye = torch.eye(C, dtype=torch.bool, device=k.device)
    A = ((kb @ k.transpose(-1, -2)) * decay).masked_fill(eye, 1.0)        # I + A: A strictly lower
    # (I + A)^-1 once per chunk rather than a solve per right-hand side. The diagonal is written as
    # ones rather than unitriangular=True, and the batch flattened to one dimension: on CPU each
    # is 2x or more faster for the same solve.
    eye_rows = torch.eye(C, device=k.device).expand(B * H * N, C, C)
    inverse = torch.linalg.solve_triangular(A.reshape(-1, C, C), eye_rows, upper=False).view(B, H, N, C, C)
    Y = inverse @ (v * beta[..., None])                                   # (B, H, N, C, Dv)
    G = logG.exp()[..., None]                                             # G_t (B, H, N, C, 1)
    kbG = kb * G                                                          # G_t beta_t k_t
    P = (q @ k.transpose(-1, -2)) * decay                                 # (B, H, N, C, C)
    kG = (k * (logG[..., -1:] - logG).exp()[..., None]).transpose(-1, -2)  # k_s G_C / G_s (.., Dk, C)
    GC = logG[..., -1].exp()[..., None, None]                             # (B, H, N, 1, 1)
    S = torch.zeros(B, H, Dk, Dv, device=v.device) if state is None else state.float()
    # only what reads the state runs chunk after chunk, in products of a chunk's size: whole-tensor
    # (B, H, N, C, D) intermediates cost a pass over memory each, which is what bounds this on a
    # CPU. unbind (not [:, :, n]): backward then stacks the chunks' gradients once instead of
    # adding N zero-filled copies of each tensor.
    Us, reads = [], []
    for Y_n, inv_n, kbG_n, q_n, kG_n, GC_n in zip(*(t.unbind(2) for t in (Y, inverse, kbG, q, kG, GC))):
        U = Y_n - inv_n @ (kbG_n @ S)                                     # the corrections (B, H, C, Dv)
        Us.append(U)
        reads.append(q_n @ S)                                             # Q S0 (B, H, C, Dv)
        S = GC_n * S + kG_n @ U
    out = torch.stack(reads, dim=2) * G + P @ torch.stack(Us, dim=2)      # (B, H, N, C, Dv)
    out = out.reshape(B, H, N * C, Dv)[:, :, :T].transpose(1, 2)          # (B, T, H, Dv)
    return out, S


class GatedDeltaNet(nn.Module):
    """The Gated DeltaNet token mixer: x (B, T, D) -> (B, T, D).

    in_proj_qkv: D -> 2*Hk*Dk + Hv*Dv (q, k, v), then a causal depthwise conv1d of kernel K with
    SiLU over those channels (each position also sees K-1 before it); q and k are L2-normalised
    per head, q scaled by 1/sqrt(Dk). in_proj_b gives beta = sigmoid(b), in_proj_a the decay
    g = -exp(A_log) * softplus(a + dt_bias) (log a_t <= 0, one per value head). The rule's output
    goes through a gated RMSNorm with z = in_proj_z(x) and out_proj: Hv*Dv -> D.
    The parameter names are those of the Qwen3.5 checkpoints, so the key map is the identity."""

    HOOKS = {"q": "(B, T, Hv, Dk) float32 queries, normalised and scaled", "k": "(B, T, Hv, Dk) float32 keys, "
             "normalised", "v": "(B, T, Hv, Dv) values", "g": "(B, T, Hv) float32 log-decay (the gate a_t = exp g)",
             "beta": "(B, T, Hv) float32 the delta rule's learning rate", "o": "(B, T, Hv, Dv) float32 the "
             "rule's output S_t^T q_t", "z": "(B, T, Hv, Dv) the output gate's input (silu(z) multiplies)",
             "state": "(B, Hv, Dk, Dv) float32 the state after the call's last position (with a cache, "
             "what the next call starts from)"}
    _taps = None                                                   # hooks.py: hooks set for a call

    def __init__(self, config):
        super().__init__()
        D = config.d_model
        self.Hk, self.Hv = config.linear_n_k_heads, config.linear_n_v_heads
        self.Dk, self.Dv = config.linear_k_head_dim, config.linear_v_head_dim
        self.kernel = config.linear_conv_kernel
        self.channels = 2 * self.Hk * self.Dk + self.Hv * self.Dv
        self.in_proj_qkv = nn.Linear(D, self.channels, bias=False)
        self.in_proj_z = nn.Linear(D, self.Hv * self.Dv, bias=False)
        self.in_proj_b = nn.Linear(D, self.Hv, bias=False)
        self.in_proj_a = nn.Linear(D, self.Hv, bias=False)
        self.conv1d = nn.Conv1d(self.channels, self.channels, self.kernel, groups=self.channels, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.Hv))
        self.A_log = nn.Parameter(torch.zeros(self.Hv))
        self.norm = GatedRMSNorm(self.Dv, config.norm_eps)
        self.out_proj = nn.Linear(self.Hv * self.Dv, D, bias=False)
        self.reset_parameters()

    @torch.no_grad()
    def reset_parameters(self) -> None:
        """A_log = log(A) with A ~ U(1, 16) (decays from fast to slow), dt_bias ones, the conv
        a normal of std 1/sqrt(K), the gated norm ones. The projections are the model's init."""
        self.A_log.copy_(torch.empty(self.Hv).uniform_(1.0, 16.0).log())
        nn.init.ones_(self.dt_bias)
        nn.init.normal_(self.conv1d.weight, 0.0, 1.0 / math.sqrt(self.kernel))
        self.norm.reset_parameters()

    def forward(self, x, *, cache=None, layer: int = 0, pad=None, impl: str = "sdpa", record=None):
        """x (B, T, D) -> (B, T, D). cache: a KVCache whose layer `layer` holds this layer's
        conv and recurrent state (cache.linear_state(layer)), advanced in place; pad (B, T) bool
        or None, False at padding positions (zeroed on the way in, so they leave the state as it
        was). impl "eager" runs the reference loop, otherwise the chunked form (one position with
        a cache: the step form). record: a dict that receives g, beta and the state norms."""
        B, T, D = x.shape
        if pad is not None:
            x = x * pad[..., None].to(x.dtype)
        state = cache.linear_state(layer) if cache is not None else None
        mixed = self._conv(self.in_proj_qkv(x).transpose(1, 2), state)   # (B, C, T)
        q, k, v = mixed.transpose(1, 2).split((self.Hk * self.Dk, self.Hk * self.Dk, self.Hv * self.Dv), dim=-1)
        q = l2_normalise(q.float().view(B, T, self.Hk, self.Dk)) / math.sqrt(self.Dk)
        k = l2_normalise(k.float().view(B, T, self.Hk, self.Dk))
        v = v.view(B, T, self.Hv, self.Dv)
        if self.Hv != self.Hk:                                    # value head j reads key head j // G
            q, k = (t.repeat_interleave(self.Hv // self.Hk, dim=2) for t in (q, k))
        q, k, v = tap(self, "q", q), tap(self, "k", k), tap(self, "v", v)                  # hook points: hooks.py
        beta = tap(self, "beta", torch.sigmoid(self.in_proj_b(x).float()))                  # (B, T, Hv)
        g = tap(self, "g", -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias.float()))
        o = tap(self, "o", self._rule(q, k, v, g, beta, state, impl))                       # (B, T, Hv, Dv)
        if record is not None:  # what inspect.mixers reads: the rule's inputs per value head
            record.update(g=g.detach(), beta=beta.detach(), q=q.detach(), k=k.detach(), v=v.float().detach())
        z = tap(self, "z", self.in_proj_z(x).view(B, T, self.Hv, self.Dv))
        o = self.norm(o.to(x.dtype), z)                                                     # (B, T, Hv, Dv)
        return self.out_proj(o.reshape(B, T, self.Hv * self.Dv))

    def _conv(self, mixed, state):
        """Causal depthwise conv1d with SiLU over mixed (B, C, T); with a cache the K-1 inputs
        before this call come from (and the last K-1 go back to) state.conv (B, C, K-1)."""
        T, K = mixed.shape[-1], self.kernel
        if state is None:
            padded = F.pad(mixed, (K - 1, 0))                                  # (B, C, K-1+T)
        else:
            padded = torch.cat((state.conv.to(mixed.dtype), mixed), dim=-1)
            if K > 1:
                state.conv.copy_(padded[..., padded.shape[-1] - (K - 1):])
        weight = self.conv1d.weight.to(mixed.dtype)                            # (C, 1, K)
        return F.silu(F.conv1d(padded, weight, groups=self.channels))[..., -T:]

    def _rule(self, q, k, v, g, beta, state, impl):
        initial = state.recurrent if state is not None else None
        if state is not None and q.shape[1] == 1 and impl != "eager":
            o = gated_delta_rule_step(q[:, 0], k[:, 0], v[:, 0], g[:, 0], beta[:, 0], state.recurrent).unsqueeze(1)
            final = state.recurrent                                # updated in place
        else:
            rule = gated_delta_rule_reference if impl == "eager" else gated_delta_rule_chunked
            o, final = rule(q, k, v, g, beta, initial)
        final = tap(self, "state", final)                          # hook point: hooks.py
        if state is not None and final is not state.recurrent:
            state.recurrent.copy_(final)
        return o
