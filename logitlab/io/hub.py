"""Hugging Face hub ids -> local directories, through huggingface_hub and its cache.

hub.py owns one step: a name such as `Qwen/Qwen3-0.6B`, `gpt2` or `Qwen/Qwen3-0.6B@main` becomes a
directory on disk, resolved exactly as transformers resolves it: `huggingface_hub.snapshot_download`
into the same cache (HF_HOME, HF_HUB_CACHE), offline when HF_HUB_OFFLINE=1, with HF_TOKEN for gated
or private models. Everything after that is the loading of a local directory (hf.py).

Only the files logitlab reads are fetched (WANTED: config, generation config, safetensors weights
and their index, tokenizer files, chat template), never pickled weights: a repository that has only
`pytorch_model.bin` is refused, because unpickling a stranger's file can run code.

A local path always wins: `resolve_model("runs/a")` is the directory runs/a when it exists, as
transformers prefers a local directory over a hub id of the same name.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

# What logitlab reads from a model repository (shell-style patterns, as snapshot_download takes).
WANTED = ["config.json", "generation_config.json", "*.safetensors", "model.safetensors.index.json",
          "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
          "chat_template.jinja", "chat_template.json"]
# What a tokenizer alone needs (tokenizer show --tokenizer ORG/NAME fetches no weights).
TOKENIZER_FILES = ["config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "chat_template.jinja", "chat_template.json"]
PICKLED = (".bin", ".pt", ".pth", ".ckpt", ".pkl")

# owner/name (or a bare name such as gpt2), each part of letters, digits, "-", "_" and "."
_REPO_ID = re.compile(r"^(?:[A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}$")


@dataclass(frozen=True)
class Resolved:
    """Where a named model lives: `directory` to load from; for a hub id also the id, the revision
    asked for and the commit it resolved to (recorded in runs and exports)."""

    directory: Path
    repo_id: str | None = None
    revision: str | None = None
    commit: str | None = None

    def pinned(self) -> str:
        """A name that loads exactly this model again: ORG/NAME@COMMIT, or the absolute directory."""
        return f"{self.repo_id}@{self.commit}" if self.repo_id else str(self.directory.resolve())

    def provenance(self) -> dict:
        """{"source": id or directory, "revision": ..., "commit": ...} for run.json and exports."""
        if self.repo_id is None:
            return {"source": str(self.directory.resolve())}
        return {"source": self.repo_id, "revision": self.revision, "commit": self.commit}


def split_revision(spec: str, revision: str | None = None) -> tuple[str, str | None]:
    """"Qwen/Qwen3-0.6B@main" -> ("Qwen/Qwen3-0.6B", "main"); a revision given both ways must agree."""
    name, at, rev = spec.partition("@")
    if not at:
        return spec, revision
    if not rev:
        raise ValueError(f"{spec!r}: nothing after '@' (write ORG/NAME@REVISION, e.g. Qwen/Qwen3-0.6B@main)")
    if revision is not None and revision != rev:
        raise ValueError(f"{spec!r} names revision {rev!r} but --revision is {revision!r}; give it once")
    return name, rev


def looks_like_hub_id(spec: str) -> bool:
    """Whether `spec` (without its @revision) has the shape of a hub id: NAME or OWNER/NAME."""
    name = spec.partition("@")[0]
    return bool(_REPO_ID.match(name)) and ".." not in name and not name.endswith((".json", ".safetensors"))


def resolve_model(spec: str | os.PathLike, revision: str | None = None, files: list[str] | None = None) -> Resolved:
    """A local directory (kept as it is) or a hub id fetched into the hub cache -> Resolved.

    files: the patterns to fetch (default WANTED, a whole model; ["config.json"] for its shape
    alone). Raises FileNotFoundError naming the path when `spec` is neither an existing path nor
    shaped like a hub id, and ValueError with one actionable line when the hub cannot serve it."""
    path = Path(spec)
    if path.exists():
        if revision is not None:
            raise ValueError(f"--revision {revision!r} names a hub revision, but {spec} is a local path")
        return Resolved(path)
    text = str(spec)
    if not looks_like_hub_id(text):
        raise FileNotFoundError(f"no such file or directory: {spec}")
    repo_id, revision = split_revision(text, revision)
    return _download(repo_id, revision, WANTED if files is None else files)


def _hub():
    try:
        import huggingface_hub
    except ImportError as exc:
        raise ImportError("loading a model by hub id needs huggingface_hub: pip install 'logitlab[hf]'",
                          name="huggingface_hub") from exc
    return huggingface_hub


def _download(repo_id: str, revision: str | None, files: list[str]) -> Resolved:
    hub = _hub()
    from huggingface_hub import constants, errors

    where = f"{repo_id}@{revision or 'main'}"
    try:
        folder = Path(hub.snapshot_download(repo_id, revision=revision, allow_patterns=files))
    except errors.GatedRepoError:
        raise ValueError(f"{where} is gated: accept its licence on the hub, then set HF_TOKEN (or run "
                         "`hf auth login`)") from None
    except errors.RepositoryNotFoundError:
        raise ValueError(f"no model {repo_id!r} on the hub (or it is private: set HF_TOKEN), and no local "
                         f"directory of that name") from None
    except errors.RevisionNotFoundError:
        raise ValueError(f"{repo_id} has no revision {revision!r} on the hub") from None
    except (errors.LocalEntryNotFoundError, errors.IncompleteSnapshotError) as exc:
        offline = " (HF_HUB_OFFLINE=1)" if constants.HF_HUB_OFFLINE else ""
        raise ValueError(f"{where}: no such local directory, not in the hub cache ({constants.HF_HUB_CACHE}), and "
                         f"the hub was not reachable{offline}") from exc
    _check_weights(folder, repo_id, revision, weights="*.safetensors" in files)
    return Resolved(folder, repo_id, revision or "main", folder.name)


def _check_weights(folder: Path, repo_id: str, revision: str | None, weights: bool) -> None:
    """Refuse a snapshot without config.json or (when `weights`) without safetensors weights,
    saying why and what to do."""
    where = f"{repo_id}@{revision or 'main'}"
    if not (folder / "config.json").is_file():
        raise ValueError(f"{where} has no config.json: it is not a transformers model repository")
    if not weights or any(folder.glob("*.safetensors")):
        return
    pickled = [name for name in _repo_files(repo_id, revision) if name.endswith(PICKLED)]
    found = f" (it has {', '.join(pickled[:3])})" if pickled else ""
    raise ValueError(f"{where} has no safetensors weights{found}. logitlab never loads pickled weights from the hub, "
                     "because unpickling a file can run code: convert them where you trust the file (transformers' "
                     "save_pretrained writes safetensors) and load that directory, or pick a repository that "
                     "publishes *.safetensors")


def _repo_files(repo_id: str, revision: str | None) -> list[str]:
    """The repository's file names, or [] when the hub cannot be asked (offline)."""
    hub = _hub()
    try:
        return list(hub.list_repo_files(repo_id, revision=revision))
    except Exception:  # offline, or the hub is down: the message goes without the list
        return []
