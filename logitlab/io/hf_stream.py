"""A model from a Hugging Face checkpoint's tensors: names and shapes checked first, then each
tensor read (or mapped) once, converted and placed.

hf_stream.py owns the streaming half of loading a Hugging Face directory (hf.py owns the
directory, its config and the checks that come before anything is built): check_hf_state refuses
names and shapes that disagree with the config, from the file headers alone; stream_model builds
the model on the meta device and fills it, the fused q/k/v and gate/up projections first
(_fused_projections), while the NaN / inf checks run beside the reads (tensors.FiniteChecks).
"""

from __future__ import annotations

import torch

from logitlab.io.tensors import FiniteChecks
from logitlab.io.weights import WeightFiles
from logitlab.model import families
from logitlab.model.transformer import ModelConfig, Transformer


def _name_first(keys: list[str]) -> str:
    more = f" (and {len(keys) - 1} more: {keys[1:4]})" if len(keys) > 1 else ""
    return f"{keys[0]!r}{more}"


def check_hf_state(hf_state: dict, config: ModelConfig, source: str = "checkpoint", model=None) -> None:
    """Refuse a checkpoint whose tensor names or shapes disagree with `config`, naming the key.
    Only names and shapes are read: meta tensors stand in for a checkpoint not yet loaded.
    `model`: the Transformer of `config` already built on the meta device, if there is one."""
    got = families.clean_hf_state(hf_state, config)
    if model is None:
        with torch.device("meta"):
            model = Transformer(config)
    # an MoE's experts: stored one per expert or stacked, as this checkpoint has them
    expected = families.state_dict_to_hf(model.state_dict(), config, expert_layout=families.expert_layout_of(got))
    missing = sorted(set(expected) - set(got))
    unexpected = sorted(set(got) - set(expected))
    if missing:
        raise ValueError(f"{source}: missing tensor {_name_first(missing)} that config.json requires")
    if unexpected:
        raise ValueError(f"{source}: unexpected tensor {_name_first(unexpected)} for this config.json")
    for key, ref in expected.items():
        if tuple(got[key].shape) != tuple(ref.shape):
            raise ValueError(f"{source}: tensor {key!r} has shape {tuple(got[key].shape)}, "
                             f"config.json implies {tuple(ref.shape)}")


def stream_model(weights: WeightFiles, config: ModelConfig, source: str, dtype=None, device=None,
                 mapped: bool = False) -> Transformer:
    """A Transformer from a checkpoint's tensors, each read once, so that at no moment is more than
    the model held (in its final dtype and device) plus the tensors in flight.

    Names and shapes are checked (check_hf_state) before anything is read. The q/k/v and gate/up
    tensors of a llama-layout checkpoint are read straight into the rows of the fused projection
    that holds them (keymap.hf_fused_pieces), allocated once in the final dtype; every other tensor is
    read, cast to `dtype`, moved to `device` (a cast commutes with the transposes and concatenations
    of the conversion, so the result is the same bit for bit) and converted by
    families.hf_tensors_to_logitlab. The tensors are assigned into a model built on the meta device.
    A floating tensor that holds NaN or inf is refused before the model is returned, naming its
    file and key (the checks run on a few threads beside the reads: tensors.FiniteChecks).
    mapped=True: the tensors that need no cast are private mappings of the files (WeightFiles.tensors);
    those the conversion keeps as they are (not transposed, split or stacked) stay so in the model,
    and the fused projections are laid out from mappings of their parts (_fused_projections)."""
    from logitlab.model.keymap import hf_fused_pieces, hf_token_table

    with torch.device("meta"):
        model = Transformer(config)
    check_hf_state({k: torch.empty(s, device="meta") for k, s in weights.shapes.items()}, config, source, model)
    # clean_hf_state decides on names alone: run over {name: name}, it maps each full HF name to
    # the name the file stores it under (buffers and a tied head's copy dropped, base-model prefix)
    names = families.clean_hf_state({k: k for k in weights.shapes}, config)
    pieces = {name: hf_fused_pieces(key, config) for key, name in names.items()}   # None: not fused
    with FiniteChecks() as finite:        # NaN / inf checks on a few threads beside the reads
        state = _fused_projections(weights, {n: p for n, p in pieces.items() if p}, mapped, dtype, device, finite)

        def cast(items):
            for key, tensor in items:  # rebound, so the uncast tensor is dropped before the next read
                tensor = tensor.to(device=device, dtype=dtype if tensor.is_floating_point() else None)
                yield key, tensor

        # the converted tensors are the model's own (final dtype and device): holding them until one
        # assignment costs nothing extra, and one load_state_dict walks the modules once
        rest = {key: name for key, name in names.items() if pieces[name] is None}
        # an untied token table: a forward pass reads only its tokens' rows, so the pages the check
        # read go again (a tied one is the head too, read whole by every forward pass)
        table = frozenset() if config.tie_embeddings else frozenset({names.get(hf_token_table(config))})
        state.update(families.hf_tensors_to_logitlab(cast(weights.tensors(rest, finite, dtype, mapped, table)),
                                                     config))
    model.load_state_dict(state, strict=False, assign=True)
    del state
    model.tie_weights()
    unread = [name for name, p in model.named_parameters() if p.is_meta]
    if unread:  # check_hf_state makes this unreachable; a conversion bug must not pass silently
        raise ValueError(f"{source}: no tensor was loaded into {_name_first(unread)}")
    model.rebuild_buffers()   # RoPE tables: float32, on the parameters' device
    return model


def _fused_projections(weights: WeightFiles, pieces: dict[str, list], mapped: bool, dtype, device,
                       finite) -> dict[str, torch.Tensor]:
    """The fused q/k/v and gate/up projections of a llama-layout checkpoint (and Qwen3.5's output
    gate, whose rows its q_proj holds), logitlab name -> tensor, from `pieces` (file name -> where
    its rows go: keymap.hf_fused_pieces). Each is allocated once in its final dtype and device and
    its pieces are read straight into its rows; with `mapped`, pieces that need no cast and lie in
    one file are instead laid out from private mappings of it (WeightFiles.map_runs): the pages each
    piece alone covers are the file's, so gate_proj then up_proj, back to back in a file with
    sorted names, take no fresh memory, and q_proj, k_proj, v_proj (o_proj lies between) a page or
    two each."""
    groups: dict[str, list] = {}
    for name, places in pieces.items():
        for fused, start, first, end, rows in places:
            groups.setdefault(fused, []).append((start, name, first, end, rows))
    shapes, stored = {}, {}
    for fused, group in groups.items():
        group.sort()
        shapes[fused], stored[fused] = (group[0][4], *weights.shapes[group[0][1]][1:]), weights.dtypes[group[0][1]]
    mappable = mapped and torch.device(device or "cpu").type == "cpu"
    state = weights.map_runs({fused: ([(name, first, end) for _, name, first, end, _ in group], shapes[fused])
                              for fused, group in groups.items() if mappable and dtype in (None, stored[fused])},
                             finite)
    places = []
    for fused, group in groups.items():
        if state.get(fused) is None:      # read into fresh memory: each piece into its rows
            state[fused] = torch.empty(shapes[fused], dtype=dtype or stored[fused], device=device)
            places += [(name, first, end, state[fused][start:start + end - first])
                       for start, name, first, end, _ in group]
    weights.fill(places, finite)
    return state
