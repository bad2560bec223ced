"""`kvserve agent fetch SOURCE DEST`: puts a model into the pod's shared volume.

SOURCE is `hf://org/name[@revision]` (through huggingface_hub, which honours HF_HOME, HF_TOKEN,
HF_HUB_OFFLINE and falls back to its cache when the Hub is unreachable) or a local/PVC directory;
a GGUF model is one file: `hf://org/name[@revision]/FILE.gguf` or a local `.gguf` path, and DEST
then holds that file alone (the runtime serves a directory with one .gguf and no config.json).
DEST gets real files (hard links where the filesystem allows, else copies), then a marker
written last; a re-run finding a matching marker and an intact directory does nothing.

Remote code is never run, so code files (`*.py` and compiled modules) are neither downloaded nor
copied; a file that cannot be written whole (disk full, read-only volume) leaves no partial file
behind; a hub revision that is not a commit hash is fetched with a warning, since a branch or tag
can move and two pods could then serve different weights under the same name.
"""

from __future__ import annotations

import errno
import fnmatch
import json
import logging
import os
import re
import shutil
import struct
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)

MARKER = ".kvserve-fetch.json"

# What a runtime needs from a repo; skips e.g. `original/` checkpoints and other formats, and
# the repository's own code (custom modeling files), which kvserve never runs.
HUB_PATTERNS = ["*.json", "*.safetensors", "*.model", "*.txt", "*.tiktoken", "*.jinja"]
# Never placed into DEST, from the hub cache or a local directory alike.
CODE_PATTERNS = ["*.py", "*.pyc", "*.pyo", "*.so", "*.dylib", "*.dll", "*.exe", "*.sh"]
_COMMIT = re.compile(r"[0-9a-f]{40}")
TOKENIZER_FILE_SETS = [("tokenizer.json",), ("tokenizer.model",), ("vocab.json", "merges.txt"), ("tokenizer.tiktoken",)]


class FetchError(RuntimeError):
    """The model cannot be fetched or is incomplete; the message lists every problem."""


@dataclass(frozen=True)
class Source:
    kind: str  # "hf" | "local"
    location: str  # repo id, directory, or (local GGUF) file
    revision: str | None = None
    filename: str | None = None  # hf: the one GGUF file of the repo to fetch

    def __str__(self) -> str:
        if self.kind == "hf":
            return (f"hf://{self.location}" + (f"@{self.revision}" if self.revision else "")
                    + (f"/{self.filename}" if self.filename else ""))
        return self.location


def parse_source(source: str) -> Source:
    if source.startswith("hf://"):
        rest = source[len("hf://") :]
        repo, at, revision = rest.partition("@")
        filename = None
        if at:  # a revision may hold slashes (refs/pr/1); a GGUF file follows its first segment
            if revision.endswith(".gguf") and "/" in revision:
                revision, _, filename = revision.partition("/")
        elif repo.count("/") > 1:
            org, name, filename = repo.split("/", 2)
            repo = f"{org}/{name}"
        parts = repo.split("/")
        if (len(parts) != 2 or not all(parts) or (at and not revision)
                or (filename is not None and (not filename.endswith(".gguf") or "" in filename.split("/")))):
            raise FetchError(f"source: {source!r} is not hf://org/name[@revision] or "
                             f"hf://org/name[@revision]/FILE.gguf")
        return Source("hf", repo, revision or None, filename)
    if source.startswith("file://"):
        source = source[len("file://") :]
    if "://" in source:
        raise FetchError(f"source: unsupported scheme in {source!r}; use hf://org/name[@rev] or a directory")
    return Source("local", os.path.abspath(source))


def _safetensors_problem(path: Path) -> str | None:
    """Checks the header and that the file is as long as the header says (catches truncation)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            raw = f.read(8)
            if len(raw) < 8:
                return f"{path.name}: truncated safetensors file"
            (n,) = struct.unpack("<Q", raw)
            if n > min(size - 8, 100 * 1024 * 1024):
                return f"{path.name}: bad safetensors header length"
            header = json.loads(f.read(n))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
        if 8 + n + end != size:
            return f"{path.name}: size {size} does not match its header ({8 + n + end}); incomplete download?"
    except (OSError, ValueError, KeyError, TypeError, IndexError) as exc:
        return f"{path.name}: unreadable safetensors file ({exc})"
    return None


def _gguf_problem(path: Path) -> str | None:
    """Reads the GGUF header and tensor table (every tensor's data must lie inside the file,
    which also catches a truncated download)."""
    from kvserve.runtime.gguf.reader import GGUFError, GGUFFile

    try:
        with GGUFFile(path) as gf:
            if not gf.tensors:
                return f"{path.name}: has no tensors"
            return None
    except GGUFError as exc:
        return f"{path.name}: {exc.field}: {exc.problem}"


def check_model_dir(directory: str | os.PathLike) -> list[str]:
    """Every reason the directory is not a loadable model: an HF directory (config, weights,
    tokenizer), or a directory with one GGUF file and no config.json."""
    d = Path(directory)
    if not d.is_dir():
        return [f"{d}: not a directory"]
    ggufs = sorted(d.glob("*.gguf"))
    if ggufs and not (d / "config.json").exists():
        if len(ggufs) > 1:
            return [f"several GGUF files ({', '.join(p.name for p in ggufs)}): keep one per model directory"]
        problem = _gguf_problem(ggufs[0])
        return [problem] if problem else []
    problems: list[str] = []
    try:
        config = json.loads((d / "config.json").read_text())
        if not isinstance(config, dict):
            problems.append("config.json: not a JSON object")
    except FileNotFoundError:
        problems.append("config.json: missing")
    except (OSError, ValueError) as exc:
        problems.append(f"config.json: unreadable ({exc})")

    index = d / "model.safetensors.index.json"
    shards: list[Path]
    if index.exists():
        try:
            names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
            shards = [d / n for n in names]
            problems += [f"{p.name}: missing (listed in {index.name})" for p in shards if not p.exists()]
            shards = [p for p in shards if p.exists()]
        except (OSError, ValueError, KeyError, AttributeError) as exc:
            problems.append(f"{index.name}: unreadable ({exc})")
            shards = []
    else:
        shards = sorted(d.glob("*.safetensors"))
        if not shards and not list(d.glob("pytorch_model*.bin")):
            problems.append("weights: no *.safetensors (or pytorch_model*.bin) file")
    for shard in shards:
        if (p := _safetensors_problem(shard)) is not None:
            problems.append(p)

    if not any(all((d / name).exists() for name in names) for names in TOKENIZER_FILE_SETS):
        problems.append("tokenizer: none of tokenizer.json, tokenizer.model, vocab.json+merges.txt found")
    return problems


def check_adapter_dir(directory: str | os.PathLike) -> list[str]:
    """Every reason the directory is not a PEFT LoRA adapter: adapter_config.json (a JSON object
    of peft_type LORA, with its rank) and adapter_model.safetensors, intact. Whether the adapter
    fits the model (rank, target modules, base model) is the runtime's to say when it loads it."""
    d = Path(directory)
    if not d.is_dir():
        return [f"{d}: not a directory"]
    problems: list[str] = []
    try:
        config = json.loads((d / "adapter_config.json").read_text())
        if not isinstance(config, dict):
            problems.append("adapter_config.json: not a JSON object")
        elif str(config.get("peft_type", "LORA")).upper() != "LORA":
            problems.append(f"adapter_config.json: peft_type {config.get('peft_type')!r} is not LORA")
    except FileNotFoundError:
        problems.append("adapter_config.json: missing")
    except (OSError, ValueError) as exc:
        problems.append(f"adapter_config.json: unreadable ({exc})")
    weights = d / "adapter_model.safetensors"
    if not weights.exists():
        problems.append("adapter_model.safetensors: missing")
    elif (p := _safetensors_problem(weights)) is not None:
        problems.append(p)
    return problems


def is_code(name: str) -> bool:
    return any(fnmatch.fnmatch(name.lower(), pattern) for pattern in CODE_PATTERNS)


def _listing(directory: Path) -> dict[str, int]:
    out = {}
    for p in sorted(directory.rglob("*")):
        rel = p.relative_to(directory)
        if p.is_file() and not any(part.startswith(".") for part in rel.parts) and not is_code(p.name):
            out[rel.as_posix()] = p.stat().st_size
    return out


def _place(src: Path, dst: Path) -> None:
    """Atomically puts src's content at dst: a hard link when possible, else a copy. A copy
    that fails (disk full) removes what it wrote: a partial file would hold the space the next
    attempt needs."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = dst.with_name(f".{dst.name}.partial")
    tmp.unlink(missing_ok=True)
    real = src.resolve()  # hub snapshots are symlinks into blobs/
    try:
        try:
            os.link(real, tmp)
        except OSError:
            shutil.copyfile(real, tmp)
        os.replace(tmp, dst)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def unpinned_warning(source: Source, commit: str | None) -> str | None:
    """A warning when a hub source names a branch or tag (or nothing) instead of a commit."""
    if source.kind != "hf" or (source.revision and _COMMIT.fullmatch(source.revision)):
        return None
    pinned = Source(source.kind, source.location, commit or "<commit>", source.filename)
    return (f"{source} is not pinned to a commit: revision {source.revision or 'main'!r} resolved to "
            f"{commit or 'an unknown commit'}, and can move; pin it as {pinned} so every pod serves the "
            f"same files")


def _marker_matches(dest: Path, source: Source) -> bool:
    try:
        marker = json.loads((dest / MARKER).read_text())
    except (OSError, ValueError):
        return False
    if marker.get("source") != str(source):
        return False
    files = marker.get("files", {})
    return bool(files) and all(
        (dest / name).is_file() and (dest / name).stat().st_size == size for name, size in files.items()
    )


def _marker_revision(dest: Path) -> str | None:
    try:
        return json.loads((dest / MARKER).read_text()).get("revision")
    except (OSError, ValueError, AttributeError):
        return None


def _hub_snapshot(source: Source) -> tuple[Path, str]:
    """Downloads (or finds in the cache) a hub snapshot; returns its directory and commit."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    env = os.environ
    cache_dir = env.get("HF_HUB_CACHE") or os.path.join(
        env.get("HF_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "huggingface"), "hub"
    )
    offline = env.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")
    try:
        path = snapshot_download(
            source.location,
            revision=source.revision,
            cache_dir=cache_dir,
            token=env.get("HF_TOKEN") or None,
            local_files_only=offline,
            allow_patterns=[source.filename] if source.filename else HUB_PATTERNS,
        )
    except LocalEntryNotFoundError as exc:
        where = "HF_HUB_OFFLINE is set and " if offline else "the Hub is unreachable and "
        raise FetchError(f"{source}: {where}the cache {cache_dir} has no snapshot for it ({exc})") from None
    except HfHubHTTPError as exc:
        raise FetchError(f"{source}: {exc}") from None
    except Exception as exc:  # huggingface_hub raises many types (auth, revision, network)
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            # Its partial file is kept on purpose: huggingface_hub resumes it on the next attempt,
            # and deleting it would not make that attempt fit either.
            raise FetchError(f"{source}: no space left in the hub cache {cache_dir} ({exc.strerror}); "
                             f"huggingface_hub keeps the partial download there (blobs/*.incomplete) and "
                             f"resumes it on the next attempt: enlarge the volume") from None
        raise FetchError(f"{source}: {type(exc).__name__}: {exc}") from None
    return Path(path), Path(path).name


def fetch(source_text: str, dest_text: str, *, adapter: bool = False) -> dict:
    """Fetches and verifies; returns a summary. Raises FetchError naming every problem.
    `adapter`: SOURCE is a LoRA adapter (check_adapter_dir), not a model."""
    check = check_adapter_dir if adapter else check_model_dir
    # An empty argument (an unset variable in a pod command) would otherwise mean the working directory.
    for field, text in (("source", source_text), ("dest", dest_text)):
        if not text.strip():
            raise FetchError(f"{field}: must not be empty")
    source = parse_source(source_text)
    if adapter and source.filename:
        raise FetchError(f"{source}: an adapter is a directory (adapter_config.json and weights), not a .gguf file")
    dest = Path(dest_text).absolute()
    if _marker_matches(dest, source) and not check(dest):
        out = {"source": str(source), "dest": str(dest), "action": "up-to-date"}
        warning = unpinned_warning(source, _marker_revision(dest))
        if warning:
            log.warning("%s", warning)
            out["warnings"] = [warning]
        return out

    single: Path | None = None  # a GGUF model: that one file, placed at the top of dest
    if source.kind == "hf":
        src_dir, revision = _hub_snapshot(source)
        if source.filename:
            single = src_dir / source.filename
            if not single.is_file():
                raise FetchError(f"{source}: the repository has no file {source.filename!r}")
    else:
        src_dir, revision = Path(source.location), None
        if src_dir.is_file() and src_dir.suffix.lower() == ".gguf" and not adapter:
            single, src_dir = src_dir, src_dir.parent
        elif not src_dir.is_dir():
            raise FetchError(f"source: {src_dir} is not a directory or a .gguf file")
    if single is not None:
        problem = _gguf_problem(single)
        if problem:
            raise FetchError(f"{source}: incomplete model: {problem}")
        files = {single.name: single.stat().st_size}
        sources = {single.name: single}
    else:
        problems = check(src_dir)
        if problems:
            raise FetchError(f"{source}: incomplete model: " + "; ".join(problems))
        files = _listing(src_dir)
        sources = {name: src_dir / name for name in files}

    try:
        dest.mkdir(parents=True, exist_ok=True)
        for name in files:
            target = dest / name
            if not (target.is_file() and target.stat().st_size == files[name] and target.samefile(sources[name])):
                _place(sources[name], target)
    except OSError as exc:  # not a directory, read-only, disk full: say so instead of a traceback
        raise FetchError(f"dest: cannot write {exc.filename or dest}: {exc.strerror or exc}") from None
    problems = check(dest)
    if problems:
        raise FetchError(f"{dest}: incomplete after copy: " + "; ".join(problems))
    warning = unpinned_warning(source, revision)
    if warning:
        log.warning("%s", warning)
    marker = {"source": str(source), "revision": revision, "files": files, "pinned": warning is None}
    tmp = dest / f".{MARKER}.partial"
    try:
        tmp.write_text(json.dumps(marker, indent=1, sort_keys=True))
        os.replace(tmp, dest / MARKER)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise FetchError(f"dest: cannot write {dest / MARKER}: {exc.strerror or exc}") from None
    out = {"source": str(source), "dest": str(dest), "action": "fetched", "revision": revision, "files": len(files)}
    if warning:
        out["warnings"] = [warning]
    return out
