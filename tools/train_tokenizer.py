"""Trains the tiny sentencepiece tokenizer from the text the repo ships (deterministic).

    python tools/train_tokenizer.py [--corpus data/corpus.txt] [--out configs/tokenizers/tiny] [--vocab 512]
    python tools/train_tokenizer.py --tasks arith,sort,reverse,recall,sortrev --out configs/tokenizers/tasks --vocab 384

With --tasks, the corpus is rendered task examples (mbd_jax/train/tasks.py, seed 0) plus
data/corpus.txt, so the trained models' tokenizer still encodes any text (byte fallback).

Ids: 0 <pad>, 1 <unk>, 2 </s> (EOS), 3 <s>, 4 <|mask|>, then the chat markers.
"""

import pathlib

import tempfile

import sentencepiece as spm
import harness  # tools/harness.py, beside this file

ROOT = pathlib.Path(__file__).resolve().parent.parent
SPECIALS = ["<|mask|>", "<|user|>", "<|assistant|>", "<|system|>", "<think>", "</think>"]


def main() -> None:
    ap = harness.parser(__doc__)
    ap.add_argument("--corpus", default=str(ROOT / "data" / "corpus.txt"))
    ap.add_argument("--out", default=str(ROOT / "configs" / "tokenizers" / "tiny"))
    ap.add_argument("--vocab", type=int, default=512)
    ap.add_argument("--tasks", help="comma-separated task names: train on their examples too")
    args = ap.parse_args()
    pathlib.Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    corpus = args.corpus
    if args.tasks:
        from mbd_jax.train.tasks import corpus_lines

        lines = corpus_lines(args.tasks.split(","), 20000)
        # a fixed path: the trainer records it in the model file, which is then byte-identical
        corpus = str(pathlib.Path(tempfile.gettempdir()) / "mbd_jax_task_corpus.txt")
        pathlib.Path(corpus).write_text("\n".join(lines) + "\n" + pathlib.Path(args.corpus).read_text())
    spm.SentencePieceTrainer.Train(
        input=corpus, model_prefix=args.out, vocab_size=args.vocab, model_type="bpe",
        pad_id=0, unk_id=1, eos_id=2, bos_id=3, user_defined_symbols=SPECIALS,
        character_coverage=1.0, byte_fallback=True, split_digits=True, num_threads=1,
        input_sentence_size=0, shuffle_input_sentence=False, minloglevel=2)
    print(f"wrote {args.out}.model")


if __name__ == "__main__":
    main()
