"""Images of sampled records: checked once each, embedded ones written once, content-addressed.

A record's image is a path (relative ones join the source's image_root), a `{bytes, path}` struct (how
`datasets.Image` is stored in parquet and Arrow), raw bytes, or a PIL image. Embedded images are checked
from memory and written to `<folder>/<first 2 hex>/<sha256 of the bytes><.ext>` (original format kept),
so the sampled JSONL holds paths, re-sampling writes nothing new, and the names depend on content only.
Every check applies to every form: readable, not truncated, at least MIN_IMAGE_SIDE pixels a side, an
aspect ratio Qwen-VL accepts, and at most MAX_IMAGE_PIXELS pixels (decompression bombs and lying headers).
"""

from __future__ import annotations

import hashlib
import io
import os
import warnings
from pathlib import Path
from typing import Any

from vlmexp.families.qwen import MAX_ASPECT_RATIO

MIN_IMAGE_SIDE = 4  # smaller images cannot be grounded (and are usually broken files)
# Pixels per image, checked from the header before decoding (PIL refuses twice this itself). Real checkpoints
# resize to at most 12.8M pixels; lower it with VLMEXP_MAX_IMAGE_PIXELS to refuse large originals earlier.
MAX_IMAGE_PIXELS = int(os.environ.get("VLMEXP_MAX_IMAGE_PIXELS", "89478485"))  # PIL's own warning threshold
EXTENSIONS = {"PNG": ".png", "JPEG": ".jpg", "WEBP": ".webp", "GIF": ".gif", "BMP": ".bmp", "TIFF": ".tif"}

Checked = tuple[str, tuple[int, int]] | str  # (path, (width, height)) or the problem


def describe(value: Any) -> str:
    """A short description of an image value for error messages (bytes never printed)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {describe(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (bytes, bytearray)):
        return f"<{len(value)} bytes>"
    text = repr(value)
    return text if len(text) <= 200 else text[:197] + "..."


def is_image_value(value: Any) -> bool:
    """An image in one of the forms above (not yet checked)."""
    if isinstance(value, str):
        return bool(value)
    if isinstance(value, (bytes, bytearray)):
        return True
    if isinstance(value, dict):
        return isinstance(value.get("bytes"), (bytes, bytearray)) or (
            value.get("bytes") is None and isinstance(value.get("path"), str) and bool(value.get("path")))
    return type(value).__module__.startswith("PIL.")


class ImageStore:
    """Checks each distinct image once and remembers the result; writes embedded images under `folder`."""

    def __init__(self, folder: Path | None):
        self.folder = folder  # None: check embedded images without writing them
        self.written: list[Path] = []  # files this store created (removed again by `discard`)
        self._seen: dict[str, Checked] = {}

    def resolve(self, value: Any, image_root: str | None) -> Checked:
        """(absolute path, (width, height)) of a record's image, or the problem and its fix."""
        if isinstance(value, dict) and value.get("bytes") is None:
            value = value.get("path")
        if isinstance(value, str):
            key = f"{image_root}\0{value}"  # resolving a path costs more than checking a seen image
            if key not in self._seen:
                self._seen[key] = self._resolve_path(value, image_root)
            return self._seen[key]
        data, name = _bytes_of(value)
        digest = hashlib.sha256(data).hexdigest()
        if digest not in self._seen:
            self._seen[digest] = self._store(data, digest, name)
        return self._seen[digest]

    def _resolve_path(self, value: str, image_root: str | None) -> Checked:
        if image_root is None and not Path(value).expanduser().is_absolute():
            return (f"relative image path {describe(value)} in a source with no image folder; set the "
                    "source's image_root")
        joined = Path(image_root or "/") / Path(value).expanduser()
        try:
            path = str(joined.resolve())
        except (RuntimeError, OSError) as e:  # RuntimeError: a symlink loop (Python < 3.13), OSError: ELOOP
            return (f"image path {joined} cannot be resolved ({e}); a symlink points back to itself: fix the "
                    "link")
        if path not in self._seen:
            self._seen[path] = self._check_file(path)
        return self._seen[path]

    def _check_file(self, path: str) -> Checked:
        p = Path(path)
        if not p.is_file():
            kind = _file_kind(p)
            if kind is None:
                return f"image not found: {path}; fix the path or the source's image_root"
            return (f"image path {path} is a {kind}, not a file (not opened); point the record at an image "
                    "file")
        try:
            with p.open("rb") as f:
                head = f.read()
        except OSError as e:
            return f"unreadable image {path} ({e.__class__.__name__}: {e}); replace or remove the file"
        checked = check_image_bytes(head, path)
        return checked if isinstance(checked, str) else (path, checked[1])

    def _store(self, data: bytes, digest: str, name: str | None) -> Checked:
        checked = check_image_bytes(data, f"embedded image <{len(data)} bytes> (sha256 {digest[:12]})")
        if isinstance(checked, str):
            return checked
        fmt, size = checked
        if self.folder is None:
            return f"<embedded sha256 {digest[:12]}>", size
        suffix = EXTENSIONS.get(fmt) or (Path(name).suffix.lower() if name else "") or ".img"
        target = self.folder / digest[:2] / f"{digest}{suffix}"
        if not target.is_file():
            from vlmexp.files import atomic_write

            atomic_write(target, data)
            self.written.append(target)
        return str(target), size

    def discard(self) -> None:
        """Remove the images this store wrote (the sampling they belong to failed)."""
        for p in self.written:
            p.unlink(missing_ok=True)
        self.written.clear()


def _bytes_of(value: Any) -> tuple[bytes, str | None]:
    if isinstance(value, dict):
        return bytes(value["bytes"]), value.get("path")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value), None
    buf = io.BytesIO()  # a PIL image: kept in its own format where it has one
    fmt = value.format or "PNG"
    value.save(buf, format=fmt)
    return buf.getvalue(), None


def _file_kind(path: Path) -> str | None:
    """What stands at `path` when it is not a regular file: a folder, a named pipe, ...; None when nothing
    does."""
    import stat

    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    kinds = ((stat.S_ISDIR, "folder"), (stat.S_ISFIFO, "named pipe"), (stat.S_ISSOCK, "socket"),
             (stat.S_ISCHR, "character device"), (stat.S_ISBLK, "block device"))
    return next((name for test, name in kinds if test(mode)), "special file")


def check_image_bytes(data: bytes, label: str) -> tuple[str, tuple[int, int]] | str:
    """(format, (width, height)) of an encoded image, or what is wrong with it and the fix."""
    from PIL import Image, UnidentifiedImageError

    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(data)) as im:
                (w, h), fmt = im.size, im.format
                if w * h > MAX_IMAGE_PIXELS:
                    return _too_large(label, w, h)
                im.verify()  # PNG: every chunk's CRC up to IEND, so truncation is caught
    except Image.DecompressionBombError as e:
        return (f"image {label} is too large to decode safely, a decompression bomb or a broken header "
                f"({e}); shrink the image or drop the record")
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError, EOFError) as e:
        return f"unreadable image {label} ({e.__class__.__name__}: {str(e)[:200]}); replace or remove it"
    if fmt == "JPEG" and b"\xff\xd9" not in data[-64:]:
        return f"truncated JPEG {label} (no end-of-image marker); re-export the file"
    if min(w, h) < MIN_IMAGE_SIDE:
        return f"image {label} is {w}x{h} pixels, below {MIN_IMAGE_SIDE}x{MIN_IMAGE_SIDE}; remove the record"
    if max(w, h) / min(w, h) > MAX_ASPECT_RATIO:
        return (f"image {label} is {w}x{h}: aspect ratio {max(w, h) / min(w, h):.0f} exceeds "
                f"{MAX_ASPECT_RATIO}, which Qwen-VL processors refuse; crop or drop it")
    return fmt or "", (w, h)


def _too_large(label: str, w: int, h: int) -> str:
    return (f"image {label} claims {w}x{h} = {w * h} pixels, over the limit of {MAX_IMAGE_PIXELS} "
            f"(a decompression bomb or a broken header); shrink the image, or raise VLMEXP_MAX_IMAGE_PIXELS")
