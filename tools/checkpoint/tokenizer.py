"""tokenizer.json for a family: byte-level BPE trained on a generated corpus, the family's
pre-tokenizer and special tokens, so text round-trips as it does through the real tokenizer."""
from __future__ import annotations

import functools
import json

from tools.checkpoint import MakeModelError
from tools.checkpoint.configs import FAMILIES, eos_ids


# ----------------------------------------------------------------------------------------------
# Tokenizer


_PROSE = """\
The river town woke slowly. Fog sat on the water until the ferry bell rang at seven, and then the
market opened: bread, apples, rope, lamp oil, and news from the valley. Nobody in the town was in a
hurry, except the clockmaker, who was always late and always running.

A small machine can learn a great deal from a few pages of plain text. It sees that "the" is common,
that words are separated by spaces, that sentences end with a full stop, and that numbers such as
12, 345 and 2024 are written with digits. It does not know what any of it means. That is fine; it
only has to cut text into pieces that are easy to count.

"Where are you going?" asked the teacher. "To the library," said Mara, "because the old maps are
there, and I want to find the road that goes over the mountain." She packed a pencil, a notebook,
two oranges and a warm coat. It's a long walk, and she'd heard the weather would turn.

Rules for the workshop: 1) Keep the floor clean. 2) Put every tool back where you found it.
3) Never leave the stove burning. 4) If something breaks, tell someone; don't hide it!

def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i * 2))

In the spring the fields turned green, in the summer they turned gold, and in the autumn the farmers
brought the harvest home on long, slow carts. The children counted the carts: one, two, three, four,
five, six, seven, eight, nine, ten. The winter was quiet, cold and very dark.
"""

_NOUNS = ("river town market bridge teacher student garden window mountain village engine "
          "library morning evening winter summer letter story question answer machine "
          "computer program number table kitchen farmer harvest bottle candle forest road "
          "ship harbor island doctor patient music song voice child friend family house "
          "door wall street city country language memory signal problem idea answer stone "
          "cloud storm light shadow paper pencil").split()
_ADJECTIVES = ("old new small large quiet busy bright dark cold warm early late simple strange "
               "careful quick slow heavy light green golden silver empty full gentle loud "
               "narrow wide ancient modern honest clever tired happy").split()
_VERBS = ("opened closed found lost carried built painted watched followed answered asked "
          "remembered forgot counted measured repaired visited crossed climbed wrote read "
          "described explained noticed changed moved carried shared learned taught").split()
_ADVERBS = ("slowly quickly carefully quietly suddenly finally often never always rarely "
            "happily gently").split()
_PREPS = "across under over near behind beside inside through along toward without".split()
_NAMES = "Mara Tomas Elena Ravi Ingrid Omar Lucia Kenji Amara Pieter".split()


class _Lcg:
    """A tiny deterministic generator (Python's `random` could change between versions)."""

    def __init__(self, seed: int):
        self.state = seed

    def pick(self, items):
        self.state = (self.state * 6364136223846793005 + 1442695040888963407) % 2**64
        return items[(self.state >> 33) % len(items)]


def _corpus() -> str:
    """~20 KB of English-ish text: the fixed prose above plus sentences from a small grammar."""
    rng = _Lcg(2024)
    lines = [_PROSE]
    for i in range(320):
        n1, n2, n3 = rng.pick(_NOUNS), rng.pick(_NOUNS), rng.pick(_NOUNS)
        a1, a2 = rng.pick(_ADJECTIVES), rng.pick(_ADJECTIVES)
        form = i % 6
        if form == 0:
            s = f"The {a1} {n1} {rng.pick(_VERBS)} the {n2} {rng.pick(_PREPS)} the {a2} {n3}."
        elif form == 1:
            s = f"{rng.pick(_NAMES)} {rng.pick(_ADVERBS)} {rng.pick(_VERBS)} a {a1} {n1}."
        elif form == 2:
            s = f"Why is the {n1} so {a1}? Because the {n2} is {a2}."
        elif form == 3:
            s = (f"In {1800 + (rng.state >> 20) % 225}, {(rng.state >> 40) % 97 + 2} {n1}s were "
                 f"{rng.pick(_VERBS)} near the {a1} {n2}.")
        elif form == 4:
            s = f"{rng.pick(_NAMES)} said, \"My {n1} is {a1}, and your {n2} is {a2}.\""
        else:
            s = f"def {rng.pick(_VERBS)}_{n1}({n2}, {n3}):\n    return {n2} + {n3}\n"
        lines.append(s)
    return "\n".join(lines) + "\n"


@functools.lru_cache(maxsize=16)
def _trained_bpe(num_tokens: int, qwen: bool) -> tuple[tuple[str, ...], tuple[tuple[str, str], ...]]:
    """A byte-level BPE trained on `_corpus()` with at most `num_tokens` tokens, split by the
    Qwen (`qwen`) or Llama 3 pre-tokenizer.

    Returns (tokens, merges) in a canonical order that does not depend on how the trainer numbers
    its vocabulary: the 256 byte symbols in byte order, then each merge's result in merge order.
    """
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    _set_pipeline(tok, qwen)
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    trainer = trainers.BpeTrainer(vocab_size=max(num_tokens, len(alphabet)), min_frequency=0,
                                  initial_alphabet=alphabet, show_progress=False,
                                  special_tokens=[])
    tok.train_from_iterator([_corpus()], trainer=trainer)
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m)
              for m in json.loads(tok.to_str())["model"]["merges"]]
    tokens = list(_byte_symbols())
    seen = set(tokens)
    for a, b in merges:
        if a + b not in seen and len(tokens) < num_tokens:
            tokens.append(a + b)
            seen.add(a + b)
    kept = [(a, b) for a, b in merges if a + b in seen]
    return tuple(tokens[:num_tokens]), tuple(kept)


def _byte_symbols() -> list[str]:
    """GPT-2's byte-to-unicode map, in byte order: the alphabet of every byte-level BPE."""
    printable = (list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
                 + list(range(ord("®"), ord("ÿ") + 1)))
    out, extra = [], 0
    for b in range(256):
        if b in printable:
            out.append(chr(b))
        else:
            out.append(chr(256 + extra))
            extra += 1
    return out


# Pre-tokenizer regexes of Llama 3 and of Qwen2/3 (which split numbers into single digits).
_LLAMA3_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+"
                 r"[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")
_QWEN_SPLIT = _LLAMA3_SPLIT.replace(r"\p{N}{1,3}", r"\p{N}")


def _set_pipeline(tok, qwen: bool) -> None:
    """Normalizer, pre-tokenizer and decoder of the real family tokenizer.

    Transformers 5 ignores tokenizer_class for model_type qwen2 and rebuilds Qwen2Tokenizer's own
    pipeline (NFC + the Qwen regex) around tokenizer.json's vocabulary and merges, so the Qwen
    pipeline here must be exactly that one for AutoTokenizer and tokenizers.Tokenizer to agree.
    """
    from tokenizers import Regex, decoders, normalizers, pre_tokenizers

    tok.normalizer = normalizers.NFC() if qwen else None
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(_QWEN_SPLIT if qwen else _LLAMA3_SPLIT), behavior="isolated",
                             invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = decoders.ByteLevel()


def _special_ids(config: dict) -> dict[int, str]:
    """id -> special token content, at the ids config.json gives bos/eos (optional extras that
    do not fit the vocabulary are left out)."""
    family = FAMILIES[config["model_type"]]
    anchor = config["bos_token_id"] if family.anchor_at_bos else 0
    specials = {anchor + off: content for content, off in family.specials
                if anchor + off < config["vocab_size"]}
    for key, ids in (("bos_token_id", [config["bos_token_id"]]),
                     ("eos_token_id", eos_ids(config))):
        for i in ids:
            if i not in specials:
                raise MakeModelError(f"{key} {i} is not where the {family.arch} layout puts a "
                                     f"special token ({sorted(specials)})")
    return specials


def build_tokenizer(config: dict) -> tuple[str, dict]:
    """(tokenizer.json text, tokenizer_config.json dict) for a config.

    A byte-level BPE trained on the embedded corpus fills the ids that are neither the family's
    special tokens nor beyond what the corpus supports; every other id below vocab_size is a
    reserved token `<|reserved_ID|>` placed directly in the BPE vocabulary (unreachable by merges,
    so it never appears when encoding text, but it decodes), so that every id decodes.
    """
    from tokenizers import AddedToken, Tokenizer, models, processors

    family = FAMILIES[config["model_type"]]
    vocab_size = config["vocab_size"]
    specials = _special_ids(config)
    if family.anchor_at_bos:  # BPE below the special tokens (Qwen, Llama 3)
        bpe_ids = range(0, min(specials))
    else:  # BPE after the special tokens (Mistral)
        bpe_ids = range(max(specials) + 1, vocab_size)
    if len(bpe_ids) < 256:
        raise MakeModelError(f"vocab_size {vocab_size} leaves {len(bpe_ids)} ids for the byte-level "
                             f"BPE, which needs at least 256 (one per byte)")
    tokens, merges = _trained_bpe(len(bpe_ids), family.qwen_pretokenizer)
    vocab = {tok: i for tok, i in zip(tokens, bpe_ids)}
    for i in range(vocab_size):
        if i in specials:
            vocab[specials[i]] = i
        elif i not in bpe_ids or i - bpe_ids.start >= len(tokens):
            vocab[f"<|reserved_{i}|>"] = i

    if len(vocab) != vocab_size:  # a trained token that collides with a special or reserved one
        raise AssertionError(f"tokenizer vocabulary has {len(vocab)} entries, not {vocab_size}")
    tok = Tokenizer(models.BPE(vocab=vocab, merges=list(merges), fuse_unk=False))
    _set_pipeline(tok, family.qwen_pretokenizer)
    tok.add_special_tokens([AddedToken(specials[i], special=True, normalized=False)
                            for i in sorted(specials)])
    bos = specials[config["bos_token_id"]]
    if family.prepend_bos:
        tok.post_processor = processors.TemplateProcessing(
            single=f"{bos} $A", pair=f"{bos} $A {bos} $B:1",
            special_tokens=[(bos, config["bos_token_id"])])
    else:
        tok.post_processor = processors.ByteLevel(trim_offsets=False)

    tokenizer_config = {
        "add_bos_token": family.prepend_bos,
        "add_eos_token": False,
        "added_tokens_decoder": {
            str(i): {"content": specials[i], "lstrip": False, "normalized": False,
                     "rstrip": False, "single_word": False, "special": True}
            for i in sorted(specials)},
        "bos_token": bos,
        "clean_up_tokenization_spaces": False,
        "eos_token": specials[eos_ids(config)[0]],
        "model_max_length": config["max_position_embeddings"],
        "pad_token": family.pad_token,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }
    tokenizer_config["unk_token"] = family.unk_token  # null for Qwen, as in the real files
    return tok.to_str(pretty=True), tokenizer_config


def generation_config(config: dict) -> dict:
    family = FAMILIES[config["model_type"]]
    eos = eos_ids(config)
    gen = {"bos_token_id": config["bos_token_id"], "do_sample": False}
    if family.pad_token is not None:  # Qwen: <|endoftext|> also ends generation, and pads
        pad_id = next(i for i, t in _special_ids(config).items() if t == family.pad_token)
        eos = eos + [pad_id] if pad_id not in eos else eos
        gen["pad_token_id"] = pad_id
    gen["eos_token_id"] = eos[0] if len(eos) == 1 else eos
    return dict(sorted(gen.items()))
