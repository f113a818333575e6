"""The Transformer: token ids (B, T) -> logits (B, T, V); a decoder by default, an encoder (BERT's
bidirectional mask, the same blocks and keys) with ModelConfig.attention="bidirectional".

transformer.py owns the Transformer module (its ModelConfig lives in config.py). It reads no
files, prints nothing and knows no family names; presets live in families.py, Hugging Face key
maps in keymap.py, checkpoint I/O in logitlab.io.

Shapes: B batch, T positions in this call, S key/value length (cached + new), D d_model,
V vocab (V_padded: the embedding and LM-head rows), H query heads, Hkv key/value heads,
G = H // Hkv, Dh head_dim, F d_ff, L layers.

The path: ids (B, T) -> tok_emb (+ pos_emb for learned positions) -> L blocks -> final_norm ->
lm_head (its first V rows only) -> logits (B, T, V), so padded rows never show.

State-dict keys (an API: checkpoints, Hugging Face maps and accounting rely on them):

    tok_emb.weight                              (V_padded, D)
    pos_emb.weight                              (context_length, D)   positions="learned" only
                                                (positions="sinusoidal": a fixed table, no key)
    blocks.{i}.attn_norm.weight / .bias         (D,)   bias only for norm="layernorm"
    blocks.{i}.attn.qkv_proj.weight / .bias     ((H+2*Hkv)*Dh, D)      rows: q, then k, then v;
                                                                       bias when qkv_bias
    blocks.{i}.attn.o_proj.weight / .bias       (D, H*Dh) / (D,)       bias when bias
    blocks.{i}.attn.q_norm.weight, k_norm.weight (Dh,)  qk_norm only
    blocks.{i}.attn.gate_proj.weight / .bias    (H*Dh or H, D)         attn_gate elementwise / headwise
    blocks.{i}.attn.sinks                       (H,)                   attn_sinks only (MLA's keys: mla.py)
    blocks.{i}.linear_attn.*                    a Gated DeltaNet layer (layer type "linear_attention",
                                                no attn.*): in_proj_qkv, in_proj_z, in_proj_b,
                                                in_proj_a, conv1d, dt_bias, A_log, norm, out_proj
                                                (deltanet.py; Qwen3.5's own names)
    blocks.{i}.mlp_norm.weight / .bias          (D,)
    blocks.{i}.mlp.gate_up_proj.weight / .bias  (2F, D) / (2F,)        mlp="swiglu": rows gate, then up
    blocks.{i}.mlp.up_proj.weight / .bias       (F, D) / (F,)          mlp="gelu"
    blocks.{i}.mlp.down_proj.weight / .bias     (D, F) / (D,)
    value_embeds.{i}.embed.weight / .gate       (V_padded, Hkv*Dh) / (Hkv,)  value_embeddings: layer i's
                                                table added to its values (attention.ValueEmbedding)
    (a layer whose mlp kind is "moe", config.mlp_kinds, has instead, moe.py; E n_experts, F moe_d_ff:)
    blocks.{i}.mlp.router.weight / .bias        (E, D) / (E,)          bias when router_bias
    blocks.{i}.mlp.router.correction_bias       (E,) float32 buffer    router="sigmoid_topk" only
    blocks.{i}.mlp.experts.gate_up_proj         (E, 2F, D)             per expert rows gate, then up
    blocks.{i}.mlp.experts.down_proj            (E, D, F)
    blocks.{i}.mlp.experts.gate_up_bias / down_bias  (E, 2F) / (E, D)  expert_bias only
    blocks.{i}.mlp.shared.gate_up_proj / down_proj   a SwiGLU of width shared_expert_d_ff, when > 0
    blocks.{i}.mlp.shared_gate.weight           (1, D)                 shared_expert_gate only
    final_norm.weight / .bias                   (D,)   (no norm weights at all when norm_affine=False)
    lm_head.weight                              (V_padded, D)  the same Parameter as tok_emb.weight
                                                               when tie_embeddings
RoPE cos/sin tables, the sinusoidal table and ALiBi's slopes are non-persistent buffers (not in
the state dict): `rebuild_buffers()`.
The fused projections (one matrix product for q, k, v and one for gate, up) are split into
Hugging Face's separate tensors by keymap.py; logitlab model directories written with separate
q_proj / k_proj / v_proj / gate_proj / up_proj keys are joined by checkpoint.upgrade_legacy_state.
With norm_placement="post" the final norm is kept, so the keys do not depend on placement.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from logitlab.model.attention import Attention, ValueEmbedding, make_value_embeddings
from logitlab.model.cache import KVCache
from logitlab.model.config import (  # noqa: F401  (re-exported: ModelConfig's old home)
    ModelConfig,
    RopeScaling,
    check_field_types,
    config_from_dict,
    conform,
    describe_type,
)
from logitlab.model.deltanet import GatedDeltaNet
from logitlab.model.hooks import final_norm, tap
from logitlab.model.layers import ATTN_IMPLS, Block
from logitlab.model.moe import Experts, Router
from logitlab.model.norms import LayerNorm, RMSNorm, ZeroCenteredRMSNorm, make_norm
from logitlab.model.positions import ALiBi, SinusoidalPositions
from logitlab.model.rope import RotaryEmbedding


class Transformer(nn.Module):
    """Token ids (B, T) -> logits (B, T, vocab_size). See the module docstring for the keys.

    attn_impl: "sdpa" (torch's fused scaled_dot_product_attention, default) or "eager" (the
    explicit reference path); a plain attribute, settable at any time.
    validate_inputs: when True (default) forward checks that ids and positions are in range,
    which reads two numbers back from the device; a decode loop that already knows its ids are
    valid may set it False to keep the step free of host syncs. Shape and length checks always run;
    the range checks are skipped while torch.compile traces the model.
    head_matmul: the function (h, weight[:V]) -> logits of a padded LM head, F.linear by default;
    fast paths replace it from outside (with every nn.Linear module's class) and restore it after.
    Compiling is done from outside, `torch.compile(model, fullgraph=True)`: forward, backward and
    cached decode trace as one graph with no breaks (a prefill and a decode length each get one
    graph; the cache length becomes a dynamic size after it first changes, not a recompile per step).
    """

    HOOKS = {"embed": "(B, T, D) token embeddings", "pos_embed": "(B|1, T, D) position embeddings (learned, "
             "sinusoidal)", "final_norm.scale": "(B, T, 1) float32: 1 / rms (1 / std for LayerNorm) of the "
             "final norm", "logits": "(B, T, V)"}
    _taps = None                                                   # hooks.py: hooks set for a call

    def __init__(self, config: ModelConfig, attn_impl: str = "sdpa"):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise ValueError(f"Transformer needs a ModelConfig, got {type(config).__name__}")
        self.config = config
        self.attn_impl = attn_impl
        self.validate_inputs = True
        V, D = config.padded_vocab_size, config.d_model
        self.tok_emb = nn.Embedding(V, D)
        self.pos_emb = None                                        # rope, alibi (in attention), none
        if config.positions == "learned":
            self.pos_emb = nn.Embedding(config.context_length, D)
        elif config.positions == "sinusoidal":
            self.pos_emb = SinusoidalPositions(config.context_length, D)
        self.rope = (RotaryEmbedding(config.rotary_dim, config.context_length, config.rope_theta,
                                     config.rope_scaling, config.rope_interleaved)
                     if config.positions == "rope" else None)
        kinds = zip(config.layer_kinds, config.mlp_kinds)          # token mixer, MLP (dense or moe)
        self.blocks = nn.ModuleList(Block(config, mixer, mlp) for mixer, mlp in kinds)
        self.value_embeds = make_value_embeddings(config, V)      # value_embeds.{i} (attention.py)
        self.final_norm = make_norm(config.norm, D, config.norm_eps, config.norm_zero_centered, config.norm_affine)
        self.lm_head = nn.Linear(D, V, bias=False)
        # The padded head's product h @ weight[:V]^T; kernels.cpu_bf16.install may replace it by equal values.
        self.head_matmul: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear
        if config.tie_embeddings:
            self.tie_weights()
        if not self.tok_emb.weight.is_meta:   # a meta build has no values to draw (and drawing costs 5 ms a layer)
            self.init_weights()

    # --- set-up ------------------------------------------------------------------------------

    @property
    def attn_impl(self) -> str:
        return self._attn_impl

    @attn_impl.setter
    def attn_impl(self, value: str) -> None:
        if value not in ATTN_IMPLS:
            raise ValueError(f"attn_impl must be one of {ATTN_IMPLS}, got {value!r}")
        self._attn_impl = value

    def tie_weights(self) -> None:
        """Make the LM head the embedding table itself (one Parameter), when tie_embeddings."""
        if self.config.tie_embeddings:
            self.lm_head.weight = self.tok_emb.weight

    def rebuild_buffers(self) -> None:
        """Recompute the non-persistent buffers (RoPE cos/sin, float32) on the parameters' device,
        and re-tie the LM head, after a model built on the meta device gets real storage:
        `load_state_dict(..., assign=True)` or `to_empty(device=...)` (which unties shared
        Parameters) followed by `init_weights()`."""
        self.tie_weights()
        for module in self.modules():                              # RoPE, sinusoidal, ALiBi tables
            if isinstance(module, (RotaryEmbedding, SinusoidalPositions, ALiBi)):
                module.rebuild(self.tok_emb.weight.device)

    @torch.no_grad()
    def init_weights(self) -> None:
        """GPT-2's initialisation (Radford et al. 2019), in one place:

        - every Linear weight and both embedding tables ~ Normal(0, init_std);
        - the residual output projections (attn.o_proj, mlp.down_proj) ~ Normal(0, init_std /
          sqrt(2L)), so the residual stream's variance does not grow with depth (2 adds per block),
          or zeros with zero_init_output (each block starts as the identity);
        - every bias zeros; every norm weight ones (LayerNorm bias zeros; a zero-centred RMSNorm's
          stored offset zeros); attention sink logits zeros; Gated DeltaNet's decay and conv as
          GatedDeltaNet.reset_parameters (its out_proj scaled as o_proj); value-embedding tables as
          the embeddings, their gates zeros; an MoE's router and experts as Router /
          Experts.reset_parameters (the experts' down projections scaled, or zeroed, as down_proj).
        A tied LM head is the embedding table and is initialised once, as the embedding."""
        std, L = self.config.init_std, self.config.n_layers
        for name, module in self.named_modules():
            if isinstance(module, nn.Linear):
                scaled = name.endswith(("o_proj", "down_proj", "out_proj"))
                if scaled and self.config.zero_init_output:
                    nn.init.zeros_(module.weight)
                elif not (module is self.lm_head and self.config.tie_embeddings):
                    nn.init.normal_(module.weight, 0.0, std / math.sqrt(2 * L) if scaled else std)
                if module.bias is not None:
                    nn.init.zeros_(module.bias)
            elif isinstance(module, nn.Embedding):
                nn.init.normal_(module.weight, 0.0, std)
            elif isinstance(module, (RMSNorm, LayerNorm, ZeroCenteredRMSNorm, GatedDeltaNet, ValueEmbedding)):
                module.reset_parameters()                          # GatedDeltaNet: its decay, conv, norm
            elif isinstance(module, Attention) and module.sinks is not None:
                nn.init.zeros_(module.sinks)
            elif isinstance(module, Router):                       # an MoE's router and experts (moe.py)
                module.reset_parameters(std)
            elif isinstance(module, Experts):
                module.reset_parameters(std, 0.0 if self.config.zero_init_output else std / math.sqrt(2 * L))

    # --- forward -----------------------------------------------------------------------------

    def forward(self, ids: torch.Tensor, *, cache: KVCache | None = None,
                positions: torch.Tensor | None = None, attn_mask: torch.Tensor | None = None,
                check_values: bool = True, records: list | None = None) -> torch.Tensor:
        """ids (B, T) -> logits (B, T, vocab_size).

        cache: a KVCache; new keys/values go to slots [cache.length, cache.length + T), attention
        reads slots [0, cache.length + T), and the cache advances by T at the end of this call.
        positions (B, T) (or (T,)) int: position of each token, default cache.length + arange(T)
        (per-row positions let left-padded rows start at 0). attn_mask (B, S') bool with S' >=
        S = cache.length + T (T without a cache): False marks key slot s of row b as padding.
        Logits come in the model's compute dtype (bf16 under bf16 weights or autocast); loss and
        sampling code upcast to float32. They are contiguous also with vocabulary padding: the
        padded rows of the LM head are never multiplied (see _head). check_values=False skips the
        range checks of ids and positions for this call (each is a host sync; a decode loop that
        checked its ids already passes it), as validate_inputs=False does for every call. records: a
        list that receives what some layers record, one dict per layer with its index under "layer"
        (an MoE layer's routing, which its training losses read; see _run)."""
        h = self._run(ids, cache, positions, attn_mask, check_values=check_values, records=records)[0]
        return tap(self, "logits", self.unembed(h))

    def forward_features(self, ids, *, cache=None, positions=None, attn_mask=None) -> torch.Tensor:
        """-> h (B, T, D), the last block's output BEFORE the final norm; forward(ids) equals
        unembed(forward_features(ids)). A prefill that needs only the last position's logits
        runs `model.unembed(model.forward_features(ids, cache=cache)[:, -1:])` and skips the
        LM head for the other T-1 positions. Same arguments and cache behaviour as forward."""
        return self._run(ids, cache, positions, attn_mask)[0]

    def forward_with_hidden(self, ids, *, cache=None, positions=None, attn_mask=None):
        """-> (logits (B, T, V), hidden: list of L+1 tensors (B, T, D)).

        As transformers' output_hidden_states: hidden[0] is the embedding output (token plus
        learned position embedding), hidden[i] the output of blocks[i-1] (1 <= i < L), and
        hidden[L] the last block's output AFTER the final norm (unembed(h) applies the final
        norm itself, so use it on hidden[:-1]; the returned logits are hidden[-1] through the LM
        head's first V rows alone)."""
        h, hidden, _ = self._run(ids, cache, positions, attn_mask, want_hidden=True)
        hidden.append(self.final_norm(h))
        return self._head(hidden[-1]), hidden

    def forward_with_attention(self, ids, *, cache=None, positions=None, attn_mask=None):
        """-> (logits (B, T, V), weights: list of L tensors (B, H, T, S)) through the eager path,
        whatever attn_impl is. Masked slots have weight 0; each row sums to 1."""
        h, _, weights = self._run(ids, cache, positions, attn_mask, want_weights=True)
        return self.unembed(h), weights

    def unembed(self, h: torch.Tensor) -> torch.Tensor:
        """h (B, T, D), a residual-stream state before the final norm -> logits (B, T, V):
        final norm, LM head, padded columns dropped (the logit lens reads any block this way)."""
        return self._head(final_norm(self, h))                     # self.final_norm(h), hook points: hooks.py

    def _head(self, h: torch.Tensor) -> torch.Tensor:
        """h (B, T, D) after the final norm -> logits (B, T, V).

        With vocabulary padding the LM head multiplies only its first V rows (a contiguous view
        of the (V_padded, D) weight) instead of slicing V columns out of (B, T, V_padded) logits:
        the same values bit for bit, but contiguous logits, so the loss's reshape copies nothing
        and backward fills no (B, T, V_padded) gradient with zeros (head + cross-entropy forward and
        backward at (1024, 384) x 50304: 1530 -> 1333 ms, 1 thread)."""
        V = self.config.vocab_size
        if self.lm_head.out_features == V:                         # no padding, or a head quantized
            logits = self.lm_head(h)                               # without its padded rows (B, T, V)
        else:
            logits = self.head_matmul(h, self.lm_head.weight[:V])  # (B, T, V) of (V_padded, D)
        cap = self.config.logit_softcap                            # soft-capping (Gemma 2): C * tanh(z / C)
        if cap is None:                                            # keeps |logit| < C smoothly, so none runs
            return logits                                          # away early; in float32, back in its dtype
        return (cap * torch.tanh(logits.float() / cap)).to(logits.dtype)

    def _run(self, ids, cache, positions, attn_mask, want_hidden=False, want_weights=False, check_values=True,
             records=None):
        """Embeddings and blocks: -> (h (B, T, D) before the final norm, hidden list, weights list).
        records: a list that receives one dict per Gated DeltaNet layer (its g and beta) and per MoE
        layer (its router_logits, experts, weights and dropped share; moe.MoE.forward)."""
        cfg = self.config
        self._check_ids(ids, check_values)
        B, T = ids.shape
        past = cache.length if cache is not None else 0
        S = past + T
        if S > cfg.context_length:
            raise ValueError(f"sequence too long: {past} cached + {T} new = {S} positions exceed "
                             f"context_length ({cfg.context_length})")
        if cache is not None and cfg.attention == "bidirectional":
            raise ValueError("a KV cache needs causal attention: with attention='bidirectional' every position "
                             "reads later ones, so cached keys and values go stale; run the whole sequence at once")
        if cache is not None and cache.batch_size != B:
            raise ValueError(f"ids have batch size {B} but the KV cache was built for {cache.batch_size}")
        if positions is None:
            positions = torch.arange(past, S, device=ids.device).unsqueeze(0)          # (1, T)
        else:
            positions = self._check_positions(positions, B, T, check_values)
        mask, is_causal = self._mask(attn_mask, B, T, past, ids.device, cfg.attention == "causal")
        # sliding-window layers mask by slot distance; Gated DeltaNet zeroes padded positions
        window = (attn_mask, torch.arange(past, S, device=ids.device))
        pad = attn_mask[:, past:S] if attn_mask is not None else None

        x = tap(self, "embed", self.tok_emb(ids))                  # (B, T, D)
        if self.pos_emb is not None:
            x = x + tap(self, "pos_embed", self.pos_emb(positions))   # (B or 1, T, D) broadcast over B
        rope, key_rope = self._rope_tables(positions, cache, S, x.dtype)
        hidden, weights = ([x] if want_hidden else []), []
        for i, block in enumerate(self.blocks):
            recorded = block.linear_attn is not None or block.mlp_type == "moe"
            record = {} if records is not None and recorded else None
            x, w = block(x, rope, cache=cache, layer=i,
                         mask=window if block.layer_type == "sliding_attention" else mask,
                         is_causal=is_causal, impl=self.attn_impl, need_weights=want_weights, pad=pad,
                         key_rope=key_rope, record=record, value_embed=self.value_embedding(i, ids))
            if record is not None:
                records.append({"layer": i, **record})
            if want_weights:
                weights.append(w)
            if want_hidden and i < len(self.blocks) - 1:
                hidden.append(x)
        if cache is not None:
            cache.advance(T)  # the one place the cache moves
        return x, hidden, weights

    def value_embedding(self, layer: int, ids: torch.Tensor) -> torch.Tensor | None:
        """Layer `layer`'s value embedding of ids (B, T) -> (B, Hkv, T, Dh), or None when the layer
        has none (ModelConfig.value_embeddings); a loop that runs the blocks itself passes it on."""
        ve = self.value_embeds
        return ve[str(layer)](ids) if ve is not None and str(layer) in ve else None

    def _rope_tables(self, positions, cache, S, dtype):
        """(cos, sin) for the queries' positions, in the residual stream's dtype, and for a cache
        that keeps keys unrotated (StreamingLLM) the tables of its slots 0 .. S-1."""
        if self.rope is None:
            return None, None
        cos, sin = self.rope(positions)                            # (B|1, T, 1, R)
        # "dynamic"/"longrope" scaling: tables of this call's length (rope.RotaryEmbedding)
        rope = (cos, sin) if cos.dtype == dtype else (cos.to(dtype), sin.to(dtype))
        if cache is None or not getattr(cache, "rotates_keys", False):
            return rope, None
        kcos, ksin = self.rope(torch.arange(S, device=positions.device).unsqueeze(0))   # (1, S, 1, R)
        return rope, (kcos.to(dtype), ksin.to(dtype))

    @staticmethod
    def _mask(attn_mask, B, T, past, device, causal: bool = True):
        """-> (mask (B|1, 1, T, S) bool or None, is_causal) for keys at slots [0, S), S = past + T.

        The query at slot past+t may read key slot s when attn_mask[b, s] and, if causal, s <= past+t
        (config.attention="bidirectional": every unpadded key, no cache so past == 0). Every query
        may always read its own slot, so a padding row never has all keys masked (which would make
        softmax NaN); padding rows' outputs are meaningless and ignored."""
        S = past + T
        if attn_mask is None:
            if not causal:
                return None, False                                 # every key: SDPA's plain path
            if past == 0:
                return None, True                                  # plain causal, SDPA's fast path
            if T == 1:
                return None, False                                 # one new query sees every slot
        q_slot = torch.arange(past, S, device=device)              # (T,)
        k_slot = torch.arange(S, device=device)                    # (S,)
        allowed = k_slot[None, :] <= q_slot[:, None]               # (T, S)
        if not causal:
            allowed = torch.ones_like(allowed)
        if attn_mask is None:
            return allowed[None, None], False                      # (1, 1, T, S)
        if attn_mask.dtype != torch.bool or attn_mask.ndim != 2 or attn_mask.shape[0] != B \
                or attn_mask.shape[1] < S:
            raise ValueError(f"attn_mask must be bool of shape (B={B}, S>={S}), got "
                             f"{attn_mask.dtype} {tuple(attn_mask.shape)}")
        own = k_slot[None, :] == q_slot[:, None]                   # (T, S)
        mask = (allowed[None] & attn_mask[:, None, :S]) | own[None]  # (B, T, S)
        return mask[:, None], False                                # (B, 1, T, S)

    def _validate_values(self, t: torch.Tensor, check: bool = True) -> bool:
        """Range checks read values back to the host: skipped when validate_inputs or this call's
        check_values is off, on the meta device, and while torch.compile traces (a data-dependent
        check would break the graph)."""
        return (check and self.validate_inputs and t.device.type != "meta"
                and not torch.compiler.is_compiling())

    def _check_ids(self, ids, check: bool = True) -> None:
        if not isinstance(ids, torch.Tensor):
            raise ValueError(f"ids must be a torch.Tensor of shape (B, T), got {type(ids).__name__}")
        if ids.dtype not in (torch.int64, torch.int32):
            raise ValueError(f"ids must be int64 (or int32), got {ids.dtype}")
        if ids.ndim != 2 or ids.shape[1] == 0:
            raise ValueError(f"ids must have shape (B, T) with T >= 1, got {tuple(ids.shape)}")
        if self._validate_values(ids, check):
            lo, hi = torch.stack(torch.aminmax(ids)).tolist()     # one host sync
            if lo < 0 or hi >= self.config.vocab_size:
                bad = lo if lo < 0 else hi
                raise ValueError(f"token id {bad} is out of range for vocab_size "
                                 f"{self.config.vocab_size} (valid ids: 0..{self.config.vocab_size - 1})")

    def _check_positions(self, positions, B, T, check: bool = True):
        if not isinstance(positions, torch.Tensor) or positions.dtype not in (torch.int64, torch.int32):
            got = positions.dtype if isinstance(positions, torch.Tensor) else type(positions).__name__
            raise ValueError(f"positions must be an int64 (or int32) tensor of shape (B, T), got {got}")
        if positions.ndim == 1:
            positions = positions.unsqueeze(0)                     # (T,) -> (1, T)
        if positions.ndim != 2 or positions.shape[1] != T or positions.shape[0] not in (1, B):
            raise ValueError(f"positions must have shape (B={B}, T={T}) or (T,), "
                             f"got {tuple(positions.shape)}")
        if self._validate_values(positions, check):
            lo, hi = torch.stack(torch.aminmax(positions)).tolist()
            if lo < 0 or hi >= self.config.context_length:
                raise ValueError(f"position {lo if lo < 0 else hi} is out of range for context_length "
                                 f"{self.config.context_length}")
        return positions
