"""Convert a Hugging Face directory to GGUF with llama.cpp's own converter, for the twins that
llama.cpp runs beside Kylin in `kylin bench`.

The llama.cpp vendored by llama-cpp-sys-2 ships `convert_hf_to_gguf.py` without the `conversion`
package it imports, so it cannot run. PyPI's `llama-cpp-python` source distribution carries the
whole of llama.cpp, that package included; this fetches it once (pinned by version and sha256,
from PyPI), keeps only the converter (`convert_hf_to_gguf.py`, `conversion/`, `gguf-py/`) under
`$KYLIN_MODELS/.llamacpp-convert/`, and runs it. Its converter is newer than the vendored
llama.cpp; the GGUF keys of the families converted here are the ones that llama.cpp reads.

The benchmark models have no tokenizer (`kylin bench` feeds token ids): for a directory without
`tokenizer.json` or `tokenizer.model` the converter runs on a shadow directory (links to the
model's files and a placeholder `tokenizer.json` of the model's vocabulary size, which some
families read to count tokens), and its vocabulary step is replaced by a placeholder
SentencePiece vocabulary of that size, so llama.cpp loads the file.

    python llamacpp_convert.py MODEL_DIR OUT.gguf [bf16|f32|q8_0] [CONVERTER FLAGS...]

Needs a Python with torch, numpy, safetensors, transformers and sentencepiece (the converter's
imports), e.g. `python3 -m venv V && V/bin/pip install torch numpy safetensors transformers
sentencepiece`.
"""
import hashlib
import json
import os
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

VERSION = "0.3.36"
SDIST = f"llama_cpp_python-{VERSION}.tar.gz"
SHA256 = "832db0699007f1be95a7e41ef12e88926b02ba836461e36a36372db2760c1a2e"
MEMBERS = ("convert_hf_to_gguf.py", "conversion/", "gguf-py/")


def converter_dir() -> Path:
    """The extracted converter, fetched and checked on first use."""
    models = Path(os.environ.get("KYLIN_MODELS", Path.home() / ".cache/kylin-models"))
    root = models / ".llamacpp-convert" / VERSION
    done = root / ".complete"
    if done.exists():
        return root / "llama.cpp"
    root.mkdir(parents=True, exist_ok=True)
    archive = root / SDIST
    if not archive.exists():
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--no-binary", ":all:", "--no-deps",
                        f"llama-cpp-python=={VERSION}", "-d", str(root)], check=True)
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()
    if digest != SHA256:
        archive.unlink()
        sys.exit(f"{archive}: sha256 {digest}, expected {SHA256}")
    prefix = f"llama_cpp_python-{VERSION}/vendor/llama.cpp/"
    with tarfile.open(archive) as tar:
        for member in tar.getmembers():
            if not member.name.startswith(prefix):
                continue
            rest = member.name[len(prefix):]
            if any(rest == m or rest.startswith(m) for m in MEMBERS) and (member.isfile() or member.isdir()):
                member.name = "llama.cpp/" + rest
                tar.extract(member, root, filter="data")
    archive.unlink()
    done.touch()
    return root / "llama.cpp"


def main() -> None:
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    model, out = Path(sys.argv[1]), Path(sys.argv[2])
    outtype = sys.argv[3] if len(sys.argv) > 3 else "bf16"
    # Further arguments go to the converter as they are (e.g. `--no-mtp` for a Qwen3.5 directory
    # without its multi-token-prediction layer).
    extra = sys.argv[4:]
    llama = converter_dir()
    sys.path.insert(0, str(llama / "gguf-py"))
    sys.path.insert(0, str(llama))
    import gguf  # noqa: E402  (the converter's own gguf-py)
    import conversion  # noqa: E402
    import convert_hf_to_gguf  # noqa: E402

    has_tokenizer = (model / "tokenizer.json").exists() or (model / "tokenizer.model").exists()
    if not has_tokenizer:
        original = convert_hf_to_gguf.get_model_class

        def get_model_class(*args, **kwargs):
            cls = original(*args, **kwargs)

            def set_vocab(self):
                # A placeholder SentencePiece vocabulary of the model's size.
                n = self.hparams.get("vocab_size") or self.hparams["text_config"]["vocab_size"]
                w = self.gguf_writer
                w.add_tokenizer_model("llama")
                w.add_tokenizer_pre("default")
                w.add_token_list(["<pad>", "<eos>", "<bos>", "<unk>"] + [f"<t{i}>" for i in range(4, n)])
                w.add_token_scores([0.0] * n)
                w.add_token_types([gguf.TokenType.CONTROL] * 4 + [gguf.TokenType.NORMAL] * (n - 4))
                w.add_bos_token_id(2)
                w.add_eos_token_id(1)
                w.add_unk_token_id(3)
                w.add_pad_token_id(0)
                w.add_add_bos_token(False)

            return type(cls.__name__, (cls,), {"set_vocab": set_vocab, "model_arch": cls.model_arch})

        convert_hf_to_gguf.get_model_class = get_model_class
        shadow = tempfile.TemporaryDirectory()
        for entry in model.iterdir():
            (Path(shadow.name) / entry.name).symlink_to(entry.resolve())
        config = json.loads((model / "config.json").read_text())
        n = config.get("vocab_size") or config["text_config"]["vocab_size"]
        vocab = {f"<t{i}>": i for i in range(n)}
        placeholder = {"model": {"type": "BPE", "vocab": vocab, "merges": []}, "added_tokens": []}
        (Path(shadow.name) / "tokenizer.json").write_text(json.dumps(placeholder))
        model = Path(shadow.name)
    del conversion
    sys.argv = ["convert_hf_to_gguf.py", str(model), "--outfile", str(out), "--outtype", outtype, *extra]
    convert_hf_to_gguf.main()


if __name__ == "__main__":
    main()
