"""A Gemma 3-size (262,144-token) SentencePiece-style vocabulary from GGUF metadata: the file
llama.cpp's converter writes for Gemma 3 (tokenizer model "llama", no merges, scores, token types:
control, byte, normal) read through kvserve's reader caps and converted by transformers, against
the Hugging Face tokenizer of the same vocabulary (GemmaTokenizer: BPE with byte fallback, spaces
as '▁', the control tokens special).

No real Gemma 3 tokenizer is on the test machine, so the vocabulary is built here: a BPE trained
with `tokenizers` on the repository's docs, then extended to 262,144 pieces with random
concatenations of two pieces. The oracle's merges follow SentencePiece's BPE rule (any two
adjacent pieces whose concatenation is a piece merge, the better-ranked piece first; a GGUF
carries only the pieces and their order), so a mismatch means the GGUF path lost or misread a
piece, a token type or a flag. The load time is printed (not asserted); see docs/benchmarks.md."""

from __future__ import annotations

import json
import pathlib
import time

import numpy as np
import pytest

SIZE = 262_144
SPECIAL = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]  # Gemma 3's first ids
BYTES = [f"<0x{b:02X}>" for b in range(256)]
ROOT = pathlib.Path(__file__).resolve().parents[1]


def _texts() -> list[str]:
    lines = [line for f in ("README.md", "docs/runtime.md") for line in (ROOT / f).read_text().splitlines()]
    return lines


def _vocabulary() -> list[str]:
    """Pieces in id order: the specials, the 256 byte pieces, a trained BPE, then concatenations."""
    from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(byte_fallback=True))
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split("▁", behavior="merged_with_previous")
    tok.train_from_iterator(_texts()[::2], trainers.BpeTrainer(vocab_size=4000, special_tokens=SPECIAL + BYTES,
                                                              show_progress=False))
    vocab = json.loads(tok.to_str())["model"]["vocab"]
    pieces = sorted(vocab, key=vocab.get)
    seen = set(pieces)
    base = np.array(pieces[len(SPECIAL) + len(BYTES):], dtype=object)
    rng = np.random.default_rng(0)
    while len(pieces) < SIZE:
        for piece in base[rng.integers(len(base), size=SIZE)] + base[rng.integers(len(base), size=SIZE)]:
            if piece not in seen:
                seen.add(piece)
                pieces.append(piece)
                if len(pieces) == SIZE:
                    break
    return pieces


def _sentencepiece_merges(pieces: list[str]) -> list[tuple[str, str]]:
    """Every split of every piece into two pieces, ranked by the merged piece's position."""
    index = {p: i for i, p in enumerate(pieces)}
    out = []
    for piece in pieces[len(SPECIAL) + len(BYTES):]:
        out.extend((piece[:k], piece[k:]) for k in range(1, len(piece)) if piece[:k] in index and piece[k:] in index)
    return out


@pytest.fixture(scope="module")
def tokenizers_pair(tmp_path_factory):
    import gguf
    from tokenizers import AddedToken
    from transformers.models.gemma.tokenization_gemma import GemmaTokenizer

    from kvserve.runtime.gguf import load_tokenizer

    root = tmp_path_factory.mktemp("tok262k")
    pieces = _vocabulary()
    index = {p: i for i, p in enumerate(pieces)}
    hf = GemmaTokenizer(vocab=index, merges=_sentencepiece_merges(pieces), add_bos_token=True)
    hf.add_special_tokens({"additional_special_tokens": [AddedToken(t, special=True, normalized=False)
                                                         for t in SPECIAL[5:]]})

    path = root / "gemma3-vocab.gguf"  # what convert_hf_to_gguf.py writes for Gemma 3's tokenizer.model
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(pieces)
    w.add_token_scores([-float(i) for i in range(len(pieces))])
    w.add_token_types([gguf.TokenType.CONTROL if p in SPECIAL else gguf.TokenType.BYTE if p in BYTES
                       else gguf.TokenType.NORMAL for p in pieces])
    for name, token in (("bos", "<bos>"), ("eos", "<eos>"), ("unk", "<unk>"), ("pad", "<pad>")):
        getattr(w, f"add_{name}_token_id")(index[token])
    w.add_add_bos_token(True)
    w.add_add_eos_token(False)
    w.add_add_space_prefix(False)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    cpu, wall = time.process_time(), time.perf_counter()
    ours = load_tokenizer(path)
    print(f"262k-token GGUF tokenizer: {path.stat().st_size / 2**20:.1f} MiB file, load {time.perf_counter() - wall:.1f} s "
          f"wall, {time.process_time() - cpu:.1f} s CPU")
    return ours, hf


def test_vocabulary_and_special_tokens(tokenizers_pair):
    ours, hf = tokenizers_pair
    assert len(ours) == len(hf) == SIZE
    assert (ours.bos_token, ours.eos_token, ours.unk_token, ours.pad_token) == ("<bos>", "<eos>", "<unk>", "<pad>")
    assert ours.convert_tokens_to_ids(["<start_of_turn>", "<0x0A>", "<end_of_turn>"]) == [5, 7 + 0x0A, 6]


def test_encode_decode_parity_with_the_hf_tokenizer(tokenizers_pair):
    """The held-out half of the docs plus whitespace runs, byte fallback (emoji, CJK), control
    tokens in the text; with and without BOS; decoding back to the text."""
    ours, hf = tokenizers_pair
    texts = _texts()[1::2] + ["hello world", "  two  spaces\n\n\tand a tab   ", "héllo wörld ✓ 🤖 数据 ∑",
                              "<start_of_turn>user\nhi there<end_of_turn>\n<start_of_turn>model\n", ""]
    for text in texts:
        ids = hf.encode(text)
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == ids[1:], text
        assert ours.decode(ids, skip_special_tokens=True) == hf.decode(ids, skip_special_tokens=True), text
        assert ours.decode(ids) == hf.decode(ids), text
