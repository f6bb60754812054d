"""GGUF twins of the Gemma 4 vision benchmark model, for llama.cpp's `llama-mtmd-cli` beside
Kylin (`scripts/bench_tower_vs_llamacpp.py`).

    /tmp/tvenv/bin/python scripts/make_gemma4_vision_gguf.py MODELS_DIR

Reads MODELS_DIR/gemma4-e2b-vl-shaped (`scripts/make_gemma4_vision_bench_model.py`) and writes
MODELS_DIR/gguf/gemma4-e2b-vl/: `text-bf16.gguf` (the language model) and `mmproj-bf16.gguf`,
`mmproj-f32.gguf`, `mmproj-f16.gguf` (the tower and `embed_vision`), with llama.cpp's own
converter (`scripts/llamacpp_convert.py` fetches it). The converter reads Gemma 4's vocabulary
only in Gemma's byte-fallback BPE form, with merges, and the projector's `image_mean` and
`image_std`; so it runs on a shadow directory: links to the model's weights and configuration, a
byte-fallback tokenizer of the same size with the same special tokens at the same ids (a few
merges), and the processor configuration with the identity mean and standard deviation that
`do_normalize: false` means. The weights are the model's, unchanged.
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from llamacpp_convert import converter_dir  # noqa: E402

models = Path(sys.argv[1])
model = models / "gemma4-e2b-vl-shaped"
out = models / "gguf" / "gemma4-e2b-vl"
out.mkdir(parents=True, exist_ok=True)
specials = {"<pad>": 0, "<eos>": 1, "<bos>": 2, "<unk>": 3, "<|image|>": 1000, "<|image>": 1001, "<image|>": 1002,
            "<|turn>": 1003, "<turn|>": 1004}
vocab_size = json.loads((model / "config.json").read_text())["text_config"]["vocab_size"]

with tempfile.TemporaryDirectory() as tmp:
    shadow = Path(tmp)
    for name in ("config.json", "model.safetensors", "generation_config.json"):
        (shadow / name).symlink_to(model / name)
    vocab = {t: i for t, i in specials.items() if i < 4}
    vocab.update({f"<0x{b:02X}>": 4 + b for b in range(256)})
    letters = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789.,?!"
    vocab.update({ch: 260 + i for i, ch in enumerate(letters)})
    vocab["▁"] = 260 + len(letters)
    merges = [("t", "h"), ("e", "r"), ("i", "n"), ("a", "n"), ("o", "n"), ("▁", "t"), ("▁", "a")]
    vocab.update({a + b: 900 + i for i, (a, b) in enumerate(merges)})
    taken = set(vocab.values()) | set(specials.values())
    vocab.update({f"<filler_{i}>": i for i in range(vocab_size) if i not in taken})
    vocab.update(specials)
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
                          "normalized": False, "special": True} for t, i in specials.items()],
        "normalizer": {"type": "Replace", "pattern": {"String": " "}, "content": "▁"},
        "pre_tokenizer": None, "post_processor": None,
        "decoder": {"type": "Sequence", "decoders": [
            {"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
            {"type": "Fuse"}]},
        "model": {"type": "BPE", "dropout": None, "unk_token": "<unk>", "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                  "vocab": vocab, "merges": [[a, b] for a, b in merges]},
    }
    (shadow / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    config = json.loads((model / "tokenizer_config.json").read_text())
    config.update(unk_token="<unk>",
                  extra_special_tokens={"image_token": "<|image|>", "boi_token": "<|image>", "eoi_token": "<image|>"})
    (shadow / "tokenizer_config.json").write_text(json.dumps(config))
    processor = json.loads((model / "preprocessor_config.json").read_text())
    processor.update(image_mean=[0.0, 0.0, 0.0], image_std=[1.0, 1.0, 1.0])
    (shadow / "preprocessor_config.json").write_text(json.dumps(processor))
    convert = converter_dir() / "convert_hf_to_gguf.py"
    runs = [([], "bf16", out / "text-bf16.gguf")] + [
        (["--mmproj"], dtype, out / f"mmproj-{dtype}.gguf") for dtype in ("bf16", "f32", "f16")]
    for flags, dtype, path in runs:
        subprocess.run([sys.executable, str(convert), str(shadow), *flags, "--outtype", dtype, "--outfile", str(path)],
                       check=True)
        print("wrote", path)
