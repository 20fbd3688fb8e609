"""Tokenizers of the ``tokenizers`` library: a ``tokenizer.json`` loaded, or trained on the
training documents at first use and written to that path for the runs after. The path may be a
``gs://`` or ``s3://`` object, read and written through the storage layer.

A trained tokenizer is byte-level BPE, GPT-2's scheme: text is read as UTF-8 bytes, each byte a
character of a 256-letter alphabet, so every text encodes (no unknown token) and every token
stands for a whole number of bytes. ``<|endoftext|>`` is its one special token; trainrun puts it
before each document, so a document's first real token is predicted from it.

``tokenizers`` is needed only here and imported inside these functions.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trainrun.data.errors import DataError
from trainrun.platform.user_cache import cache_dir
from trainrun.storage import location
from trainrun.storage.atomic import replace_file

Location = location.Location

DOCUMENT_TOKEN = "<|endoftext|>"  # before each document (GPT-2's separator)
INSTALL = "pip install 'trainrun[text]'"


def library() -> Any:
    try:
        import tokenizers
    except ImportError:
        raise DataError(f"data.tokenizer needs the tokenizers package, which is not installed: "
                        f"{INSTALL}") from None
    return tokenizers


def load_or_train(path: str, texts: Callable[[], Sequence[str]], vocab_size: int) -> Any:
    """The tokenizer at ``path``; when there is no file there, one trained on ``texts()`` with
    at most ``vocab_size`` tokens, written to ``path`` (folders made as needed; on object
    storage, only if no other run wrote it meanwhile: the first one written is used).

    Raises DataError for a file that is not a tokenizer, one with more tokens than
    ``vocab_size`` or one without the document token."""
    file = location.location(path)
    if not file.exists() and not file.is_symlink() and not file.is_dir():
        data = train(texts(), vocab_size).to_str().encode()
        try:
            file.parent.make_dirs()
            file.create(data)
        except OSError as err:
            raise DataError(f"cannot write {str(file)!r} ({err.strerror}); point "
                            "data.tokenizer at a writable place") from None
    return load(path, vocab_size)


def load(path: str, vocab_size: int) -> Any:
    """The tokenizer at ``path`` (checked as ``load_or_train`` checks it); a missing file is a
    DataError."""
    lib = library()
    file = location.location(path)
    if file.is_dir() and not file.is_file():
        raise DataError(f"data.tokenizer {path!r} is a folder; give the path of a "
                        "tokenizer.json file (it is trained and written there when missing)")
    if not file.is_file():
        if file.local_path is None:
            raise DataError(f"data.tokenizer: {file.missing_line('object')}; give the "
                            "location of a tokenizer.json")
        raise DataError(f"data.tokenizer {path!r} not found (a relative path is taken from the "
                        "directory you run in); run from where the run was trained, or give the "
                        "tokenizer's path")
    text = _object_text(file) if file.local_path is None else None
    try:
        tokenizer = (lib.Tokenizer.from_file(str(file.local_path)) if text is None
                     else lib.Tokenizer.from_str(text))
    except Exception as err:  # the library raises a bare Exception for bad JSON
        raise DataError(f"data.tokenizer: cannot read {path!r} as a tokenizer.json of the "
                        f"tokenizers library ({err})") from None
    size = tokenizer.get_vocab_size(with_added_tokens=True)
    if size > vocab_size:
        raise DataError(f"data.tokenizer {path!r} has {size} tokens, more than data.vocab_size="
                        f"{vocab_size}; set data.vocab_size (and model.vocab) to at least {size}")
    if tokenizer.token_to_id(DOCUMENT_TOKEN) is None:
        raise DataError(f"data.tokenizer {path!r} has no {DOCUMENT_TOKEN} token, which is put "
                        "before each document; add it to the tokenizer as a special token")
    return tokenizer


def train(texts: Sequence[str], vocab_size: int) -> Any:
    """A byte-level BPE tokenizer of ``vocab_size`` tokens (fewer when the texts run out of
    pairs to merge) trained on ``texts``."""
    lib = library()
    tokenizer = lib.Tokenizer(lib.models.BPE())
    tokenizer.pre_tokenizer = lib.pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = lib.decoders.ByteLevel()
    trainer = lib.trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[DOCUMENT_TOKEN], show_progress=False,
        initial_alphabet=lib.pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer, length=len(texts))
    return tokenizer


def _object_text(file: Location) -> str:
    """A tokenizer file on object storage as text; not UTF-8 is one line."""
    try:
        return file.read_text()
    except UnicodeDecodeError as err:
        raise DataError(f"data.tokenizer: {file} is not UTF-8 text ({err.reason} at byte "
                        f"{err.start}); give a tokenizer.json") from None
    except FileNotFoundError:
        raise DataError(f"data.tokenizer: {file.missing_line('object')}; give the "
                        "location of a tokenizer.json") from None


def encoded_cache(path: str) -> Path:
    """Where token ids encoded with the tokenizer at ``path`` are kept: ``<tokenizer>.cache/``
    beside a local file, the local cache directory for one on object storage (its entries are
    keyed by the tokenizer and the texts, so tokenizers share it safely)."""
    file = location.location(path).local_path
    if file is None:  # on object storage: this machine's cache
        return cache_dir() / "encoded-text"
    return file.with_name(file.name + ".cache")


def token_bytes(tokenizer: Any) -> np.ndarray:
    """Bytes of text each token id stands for (``uint16`` by id; 0 for special tokens): exact
    for byte-level tokenizers, the UTF-8 length of the token decoded alone otherwise."""
    vocab = tokenizer.get_vocab(with_added_tokens=True)
    table = np.zeros(max(vocab.values()) + 1, np.uint16)
    special = {i for i, token in tokenizer.get_added_tokens_decoder().items() if token.special}
    decoder = (json.loads(tokenizer.to_str()).get("decoder") or {}).get("type")
    byte_of = {char: byte for byte, char in byte_alphabet().items()}
    for token, i in vocab.items():
        if i in special:
            continue
        if decoder == "ByteLevel" and all(char in byte_of for char in token):
            table[i] = len(token)  # one alphabet letter per byte
        else:
            table[i] = len(tokenizer.decode([i]).encode())
    return table


def encode(tokenizer: Any, texts: Sequence[str], cache: Path | None = None) -> list[np.ndarray]:
    """Each text's token ids after the document token (uint16 where the vocabulary fits it,
    else uint32). ``cache``: a folder where the ids are kept by a hash of the tokenizer and the
    texts, so the next run with the same ones reads them instead of encoding again."""
    dtype = np.uint16 if tokenizer.get_vocab_size(with_added_tokens=True) <= 2**16 else np.uint32
    key = hashlib.sha256(tokenizer.to_str().encode())
    for text in texts:
        key.update(len(text).to_bytes(8, "little"))
        key.update(text.encode("utf-8", "surrogatepass"))
    file = None if cache is None else cache / f"{key.hexdigest()[:24]}.npz"
    if file is not None and file.is_file():
        try:
            with np.load(file) as saved:
                ids, lengths = saved["ids"], saved["lengths"]
            return np.split(ids, np.cumsum(lengths)[:-1]) if len(lengths) else []
        except (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile):
            pass  # an unreadable entry: encode again and write it anew
    first = tokenizer.token_to_id(DOCUMENT_TOKEN)
    # encode_batch_fast (tokenizers >= 0.20) skips the offsets, which are not needed here.
    batch = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)
    docs = [np.array([first, *encoding.ids], dtype)
            for encoding in batch(list(texts), add_special_tokens=False)]
    if file is not None:
        lengths = np.array([doc.size for doc in docs], np.int64)
        blob = np.concatenate(docs) if docs else np.zeros(0, dtype)
        with contextlib.suppress(OSError):  # a read-only place: encode again next time
            file.parent.mkdir(parents=True, exist_ok=True)
            replace_file(file, _npz_bytes(ids=blob, lengths=lengths))
    return docs


def _npz_bytes(ids: np.ndarray, lengths: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, ids=ids, lengths=lengths)
    return buffer.getvalue()


def byte_alphabet() -> dict[int, str]:
    """GPT-2's byte-level alphabet: printable bytes stand for themselves, the others for the
    characters from U+0100 on, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
                 *range(ord("®"), ord("ÿ") + 1)]
    letters = {byte: chr(byte) for byte in printable}
    extra = 0
    for byte in range(256):
        if byte not in letters:
            letters[byte] = chr(256 + extra)
            extra += 1
    return letters
