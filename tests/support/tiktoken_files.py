"""A tiktoken vocabulary file (the JSON list megatron-core's TikTokenizer reads: ``rank``,
``token_bytes`` base64, ``token_str``) learned here by byte-pair merges over the shipped corpus head:
what a Llama-3/Nemotron user's data was tokenized with, small, and made because nothing is downloaded."""

from __future__ import annotations

import base64
import collections
import json
from pathlib import Path

from support.bpe_files import corpus_head

SPECIAL = 1000  # megatron-core's --tiktoken-num-special-tokens default


def tiktoken_vocab(root: Path, *, merges: int = 200, documents: int = 200) -> tuple[Path, int]:
    """(vocabulary JSON, the --vocab-size it needs: entries + special tokens) of up to ``merges``
    byte-pair merges learned over the corpus head's most frequent whitespace-split words."""
    texts = [json.loads(line)["text"] for line in corpus_head(root, documents).read_text().splitlines()]
    # the 1,500 most frequent words carry the common merges and keep this under a few seconds
    words = dict(collections.Counter(w for t in texts for w in t.encode("utf-8").split(b" ") if w).most_common(1500))
    pieces = {w: [bytes([b]) for b in w] for w in words}
    vocab = [bytes([b]) for b in range(256)]
    seen = set(vocab)
    for _ in range(merges):
        pairs = collections.Counter()
        for w, parts in pieces.items():
            for a, b in zip(parts, parts[1:]):
                pairs[a, b] += words[w]
        if not pairs:
            break
        (a, b), _ = pairs.most_common(1)[0]
        if a + b not in seen:  # another pair may have made the same bytes: every entry once
            vocab.append(a + b)
            seen.add(a + b)
        for w, parts in pieces.items():
            out, i = [], 0
            while i < len(parts):
                if i + 1 < len(parts) and parts[i] == a and parts[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(parts[i])
                    i += 1
            pieces[w] = out
    path = root / "tiktoken.json"
    path.write_text(json.dumps([{"rank": i, "token_bytes": base64.b64encode(t).decode(),
                                 "token_str": t.decode("utf-8", errors="replace")} for i, t in enumerate(vocab)]))
    return path, len(vocab) + SPECIAL
