"""The tensors of a model directory, listed from the file headers, then read once each.

weights.py owns reading weights lean: names, shapes and dtypes come from the headers (safetensors)
before any tensor is read, so a loader checks them against the config (the layer count first,
`check_layers`) and estimates memory before it builds anything; then each tensor is read once and cast
as it arrives (tensors.read_tensor: a tensor cast to another dtype comes a slice of rows at a time,
so no full-size copy in the stored dtype ever exists). Hugging Face's layouts
(model.safetensors, sharded with model.safetensors.index.json, pytorch_model.bin and its index) are
told apart here; what the names mean is keymap.py's, what a directory is hf.py's and model_dir.py's.

safetensors are read with pread(2) into fresh CPU tensors by default, so the model owns its
memory; tensors(mapped=True) leaves the tensors kept in their stored dtype as private mappings of
the file instead (tensors.read_tensor), each mapping only its own tensor's pages, unmapped with it.
A .bin is
memory-mapped where torch's zip format allows (torch.load(mmap=True, weights_only=True): never
unpickles code, and only the pages of tensors read become resident); a .bin tensor the loader keeps
as it is (no cast, no transpose) still points into the map, which then lives as long as the model.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from logitlab.io import model_dir, tensors
from logitlab.io.model_dir import check_layers  # noqa: F401  (importable from here)

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
TORCH_BIN = "pytorch_model.bin"
TORCH_BIN_INDEX = "pytorch_model.bin.index.json"


class WeightFiles:
    """The tensors of a Hugging Face directory, whichever of the four layouts it uses, listed
    before any is read: `shapes` (name -> shape) and `dtypes` (name -> the stored torch dtype) let
    names, shapes and sizes be checked first, and `tensors(names)` then reads the wanted tensors
    one at a time, file by file, so a loader converts and drops each before the next.
    `files` maps each name to the file that holds it."""

    def __init__(self, directory: str | os.PathLike):
        d = Path(directory)
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.dtypes: dict[str, torch.dtype] = {}
        self.files: dict[str, Path] = {}           # tensor name -> the file that holds it
        self._bin: dict[Path, dict] = {}           # .bin file -> its (memory-mapped) tensors
        if (d / SAFETENSORS).is_file():
            self.add(d / SAFETENSORS)
            return
        for index_name in (SAFETENSORS_INDEX, TORCH_BIN_INDEX):
            if (d / index_name).is_file():
                weight_map = model_dir.read_json_object(d / index_name, "index file").get("weight_map")
                if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                    raise ValueError(f"{d / index_name} has no weight_map (an object of tensor name -> file name)")
                for shard in sorted(set(weight_map.values())):
                    if not (d / shard).is_file():
                        raise FileNotFoundError(f"shard {shard} named in {d / index_name} is missing")
                    self.add(d / shard)
                missing = sorted(set(weight_map) - set(self.shapes))
                if missing:
                    raise ValueError(f"{d / index_name} lists tensors its shards lack: {missing[:5]}")
                return
        if (d / TORCH_BIN).is_file():
            self.add(d / TORCH_BIN)
            return
        raise FileNotFoundError(f"no weights in {d}: expected {SAFETENSORS}, {SAFETENSORS_INDEX}, "
                                f"{TORCH_BIN} or {TORCH_BIN_INDEX}")

    def add(self, path: Path) -> None:
        """List the tensors of one file (its header only, for safetensors)."""
        if path.suffix == ".safetensors":
            for key, (shape, dtype) in tensors.read_header(path).items():
                self.shapes[key], self.dtypes[key], self.files[key] = shape, dtype, path
            return
        import zipfile

        # tensors only, no code; a pre-1.6 (non-zip) file cannot be memory-mapped
        state = model_dir.load_torch_file(path, mmap=zipfile.is_zipfile(path))
        if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
            raise ValueError(f"{path}: expected a state dict (tensor name -> tensor), got {type(state).__name__}")
        self._bin[path] = state
        for key, tensor in state.items():
            self.shapes[key] = tuple(tensor.shape)
            self.dtypes[key] = tensor.dtype
            self.files[key] = path

    def stored_dtype(self) -> torch.dtype:
        """The dtype of the floating tensors as stored (the widest, when they differ)."""
        return max((d for d in self.dtypes.values() if d.is_floating_point), key=lambda d: d.itemsize,
                   default=torch.float32)

    def describe(self) -> str:
        """The file that holds the tensors, or how many shards do, for messages."""
        held = sorted(set(self.files.values()))
        return str(held[0]) if len(held) == 1 else f"the {len(held)} shards in {held[0].parent}" if held else "no file"

    def tensors(self, names: dict[str, str], finite=False, dtype: torch.dtype | None = None,
                mapped: bool = False, let_go: frozenset = frozenset()):
        """(key, tensor) for each key -> file name in `names`, in file order, read one at a time.
        dtype: floating tensors come cast to it (tensors.read_tensor). A .bin file's memory map (and
        its unread tensors) is released after its last tensor. finite=True: a floating tensor that
        holds NaN or inf is a ValueError naming file and name (a tensors.FiniteChecks: raised by its
        wait(), the checks running beside the reads). mapped=True: a safetensors tensor
        that needs no cast comes as a private, copy-on-write mapping of the file's bytes; those named
        in let_go have the pages the check read let go again (tensors.read_tensor)."""
        for path, wanted in self._by_file(names):
            if path in self._bin:
                state = self._bin.pop(path)
                for key, name in wanted:
                    yield key, tensors.cast_read(path, name, state.pop(name), finite, dtype)
                del state
                continue
            with tensors.open_safetensors(path) as f:
                for key, name in wanted:
                    yield key, tensors.read_tensor(f, path, name, self.shapes[name], self.dtypes[name], finite, dtype,
                                                   mapped, name in let_go)

    def fill(self, places: list[tuple[str, int, int, torch.Tensor]], finite=False) -> None:
        """Read rows [first, end) of each file name in `places` ((name, first, end, out) each)
        straight into out (tensors.read_into: the rows of a fused projection, say), file by file,
        casting to out's dtype."""
        by_file: dict[Path, list] = {}
        for place in places:
            by_file.setdefault(self.files[place[0]], []).append(place)
        for path in sorted(by_file):
            wanted = sorted(by_file[path], key=lambda place: place[:3])
            if path in self._bin:
                for name, first, end, out in wanted:
                    out.copy_(tensors.cast_read(path, name, self._bin[path][name][first:end], finite, None))
                continue
            with tensors.open_safetensors(path) as f:
                for name, first, end, out in wanted:
                    tensors.read_into(f, path, name, self.shapes[name], self.dtypes[name], out, finite, (first, end))

    def map_runs(self, runs: dict[str, tuple[list, tuple]], finite=False) -> dict[str, torch.Tensor | None]:
        """key -> (pieces, shape) -> key -> one tensor of `shape` made of the rows `pieces` name
        ((name, first row, end row) each: the parts of a fused projection, in its row order), laid
        out from private mappings of the file that holds them all in one dtype
        (tensors.SafetensorsFile.map_run): no copy where the file holds them back to back in that
        order, a page or two per part read where they lie apart; None where they cannot be mapped
        (a .bin, two files or dtypes, under tensors.MAP_MIN_BYTES). Each file is opened once.
        finite (as for tensors()): every piece is checked for NaN / inf, naming its tensor."""
        out: dict[str, torch.Tensor | None] = dict.fromkeys(runs)
        by_file: dict[Path, list] = {}
        for key, (pieces, shape) in runs.items():
            names = list(dict.fromkeys(name for name, _, _ in pieces))
            path, dtype = self.files[names[0]], self.dtypes[names[0]]
            if (path.suffix == ".safetensors" and all(self.files[n] == path and self.dtypes[n] == dtype for n in names)
                    and dtype.itemsize * torch.Size(shape).numel() >= tensors.MAP_MIN_BYTES):
                by_file.setdefault(path, []).append((key, pieces, shape, dtype))
        for path in sorted(by_file):
            with tensors.open_safetensors(path) as f:
                for key, pieces, shape, dtype in by_file[path]:
                    out[key] = f.map_run(pieces, shape, dtype, _check_pieces(path, pieces, finite) if finite else None)
        return out

    def _by_file(self, names: dict[str, str]):
        """(file, [(key, name), ...] sorted by name) for the files that hold `names`, in file order."""
        by_file: dict[Path, list[tuple[str, str]]] = {}
        for key, name in names.items():
            by_file.setdefault(self.files[name], []).append((key, name))
        return [(path, sorted(by_file[path], key=lambda kn: kn[1])) for path in sorted(by_file)]


def _check_pieces(path: Path, pieces: list, finite):
    """The check a mapped run of `pieces` gets (SafetensorsFile.map_run's check): every piece checked
    for NaN / inf, naming its tensor, at once or queued on `finite` (a tensors.FiniteChecks); the
    pages stay (a forward pass reads them all)."""
    starts = [sum(end - first for _, first, end in pieces[:i]) for i in range(len(pieces))]

    def check(joined: torch.Tensor, release) -> None:
        def job():
            for (name, first, end), at in zip(pieces, starts):
                tensors.require_finite(path, name, joined[at:at + end - first])
        finite.queue(job) if isinstance(finite, tensors.FiniteChecks) else job()

    return check
