"""A GGUF model small enough to carry: a model's metadata and tokenizer without its weights (`vocab`, a few MB), and,
where it is needed, the same model with seeded random weights (`fill`). For llama.cpp on a machine that one call
cannot bring a real GGUF to (SmolLM2-135M's Q4_1 is 98 MB; a call carries 64 MiB with the repository): serving
throughput depends on the shapes, not on the weights' values.

    python -m benchmarks.gguf_random vocab SRC.gguf DST.gguf     every key/value of SRC (tokenizer, hyperparameters)
                                                                 and its tensors' names and shapes, no tensor data
    python -m benchmarks.gguf_random fill VOCAB.gguf DST.gguf [--seed S]
                                                                 a model of VOCAB's shapes: matrices F16 drawn from
                                                                 N(0, 0.02^2), vectors (norms) F32 ones

Needs only numpy and `gguf` (the package, or llama.cpp's gguf-py on PYTHONPATH). `fill`'s model is F16
(general.file_type 1): SmolLM2-135M-shaped, 271 MB.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

SHAPES_KEY = "sparecycles.tensor_shapes"  # JSON [[name, [ne0, ne1, ...]], ...] in ggml's order
SKIP = ("GGUF.", "general.architecture", "general.file_type", SHAPES_KEY)


def _copy_fields(reader, writer) -> None:
    """Every key/value of `reader` but GGUF's own header fields, the architecture (the writer's) and the file type."""
    import gguf

    for key, field in reader.fields.items():
        if key.startswith(SKIP):
            continue
        vtype = field.types[0]
        sub = field.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        writer.add_key_value(key, field.contents(), vtype, sub_type=sub)


def _arch(reader) -> str:
    return reader.fields["general.architecture"].contents()


def vocab(src: Path, dst: Path) -> None:
    """Write `dst`: `src`'s metadata and its tensors' shapes (SHAPES_KEY), no tensors."""
    import gguf

    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(dst, _arch(reader))
    _copy_fields(reader, writer)
    writer.add_string(SHAPES_KEY, json.dumps([[t.name, [int(n) for n in t.shape]] for t in reader.tensors]))
    _write(writer)


def fill(src: Path, dst: Path, seed: int = 0) -> None:
    """Write `dst`: `src`'s metadata (a `vocab` file) with seeded random tensors of its recorded shapes. Raises
    ValueError for a file without SHAPES_KEY."""
    import gguf
    import numpy as np

    reader = gguf.GGUFReader(src)
    if SHAPES_KEY not in reader.fields:
        raise ValueError(f"{src}: no {SHAPES_KEY} (write it with `python -m benchmarks.gguf_random vocab`)")
    shapes = json.loads(reader.fields[SHAPES_KEY].contents())
    writer = gguf.GGUFWriter(dst, _arch(reader))
    _copy_fields(reader, writer)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    rng = np.random.default_rng(seed)
    for name, ne in shapes:
        shape = tuple(reversed(ne))  # numpy's order is ggml's reversed
        if len(shape) == 1:
            writer.add_tensor(name, np.ones(shape, dtype=np.float32))
        else:
            writer.add_tensor(name, (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float16))
    _write(writer)


def _write(writer) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("vocab", help="metadata and shapes only")
    v.add_argument("src", type=Path)
    v.add_argument("dst", type=Path)
    f = sub.add_parser("fill", help="seeded random weights of a vocab file's shapes")
    f.add_argument("src", type=Path)
    f.add_argument("dst", type=Path)
    f.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    if a.cmd == "vocab":
        vocab(a.src, a.dst)
    else:
        fill(a.src, a.dst, a.seed)
    print(f"{a.dst}: {a.dst.stat().st_size} bytes")


if __name__ == "__main__":
    main()
