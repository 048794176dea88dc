"""The `jaxmodels` command: convert, export, inspect, generate, serve."""
from __future__ import annotations

import argparse
import json
import logging
import math
import os
import socket
import sys
import traceback
from pathlib import Path

DTYPES = ("bfloat16", "float32", "float16")


def _convert(args) -> int:
    import converters

    dst = converters.convert(args.src, args.dst, dtype=args.dtype, overwrite=args.force,
                             keep_quantized=args.keep_quantized, skip_mtp=args.skip_mtp, progress=args.progress)
    print(f"converted {args.src} -> {dst}")
    return 0


def _export(args) -> int:
    import converters

    size = int(args.max_shard_size) if args.max_shard_size.isdigit() else args.max_shard_size
    dst = converters.export(args.src, args.hf_dir, dtype=args.dtype, overwrite=args.force, max_shard_size=size,
                            progress=args.progress)
    print(f"exported {args.src} -> {dst}")
    return 0


def describe(path: str | Path) -> dict:
    """Architecture, layer plan, parameter count and bytes of a converted dir or a source checkpoint."""
    from jaxmodels import checkpoint, families, files, plan

    path = files.locate(path)
    if checkpoint.is_converted(path):
        cfg, dtype = checkpoint.load_config(path), checkpoint.load_meta(path).get("dtype")
    elif path.suffix == ".gguf":
        from converters.gguf_io import GGUFReader

        cfg, dtype = families.config_from_hf(GGUFReader(path).hf_config), "gguf (quantized)"
    else:
        if (config := files.find(path, "config.json")) is None:
            raise FileNotFoundError(f"{path}: no config.json (expected an HF model directory, a .gguf file or a "
                                    f"converted model)")
        cfg, dtype = families.config_from_hf(files.read_json(config, files.MAX_METADATA_BYTES)), "source"
    width = {"bfloat16": 2, "float16": 2, "float32": 4}.get(dtype if isinstance(dtype, str) else "", None)
    n = plan.param_count(cfg)
    nbytes, quantized = n * width if width else None, False
    if checkpoint.is_converted(path) and (path / "params").is_dir():  # what is stored (kept-quantized: its bytes)
        try:
            leaves = checkpoint.stored_leaves(path / "params")
        except ValueError:  # a damaged leaf header: `load` names it; the config alone describes the model
            leaves = {}
        want = plan.flatten(plan.param_specs(cfg))
        base = {leaf: checkpoint.planned_base(leaf, want) for leaf in leaves}
        if planned := [leaf for leaf, b in base.items() if b in want]:  # (MTP weights: not in `parameters` either)
            nbytes = sum(math.prod(leaves[leaf][1]) * leaves[leaf][2].itemsize for leaf in planned)
            quantized = any(base[leaf] != leaf for leaf in planned)
    pl = plan.plan(cfg)
    kinds = []
    for k, spec in enumerate(pl.kinds):
        a, m = spec.attention, spec.mlp
        rope = "NoPE" if a.rope is None else f"{a.rope.kind} θ={a.rope.theta:g}" + (" interleaved" if a.rope.interleaved else "")
        attn = ("sliding W=%d" % a.window) if a.window else "full causal"
        if a.kind == "mla":
            r = a.mla
            rope += f" (last {r.rope_dim})"
            attn = f"latent, window W={a.window}" + (f" + 1/{r.ratio} compressed ({r.select}" + (", own" if r.compress else "")
                                                   + ")" if r.ratio else "")
            extra = [x for x, on in (("engram", spec.engram >= 0), ("hash-routed", m.router == "hash"),
                                     ("candidate source", r.candidate_source), ("candidate filter", r.candidate_filter)) if on]
            attn += f"; {', '.join(extra)}" if extra else ""
        router = f" {m.router}" + (f"/{m.score_func}" if m.router in ("biased_topk", "hash") else "")
        kinds.append({
            "kind": k, "layers": [i for i, x in enumerate(pl.kind_of) if x == k], "attention": attn, "rope": rope,
            "qk_norm": a.qk_norm, "bias": a.qkv_bias, "sinks": a.sinks,
            "mlp": f"{m.kind} {m.activation} I={m.intermediate_size}" + (
                f"{router} {m.num_experts} experts top-{m.top_k}" if m.kind == "moe" else ""),
            "block": spec.block if spec.mhc is None else f"mHC x{spec.mhc.copies}", "norm": spec.norm,
        })
    return {"family": cfg.family, "path": str(path), "dtype": dtype, "vocab": cfg.vocab_size,
            "hidden": cfg.hidden_size, "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads,
            "head_dim": cfg.head_dim, "layers": cfg.num_layers, "tied": cfg.tie_embeddings,
            "parameters": n, "bytes": nbytes, "kept_quantized": quantized,
            "scan": f"{_runs(pl, pl.runs)} ({pl.bodies()} layer bodies traced)" + (
                f", {cfg.numerics} numerics" if cfg.numerics != "plain" else ""),
            "kinds": kinds, "vision": _vision(cfg)}


def _vision(cfg) -> dict | None:
    """The vision tower of a multimodal model, in the words of its spec."""
    from jaxmodels import plan

    v = cfg.vision
    if v is None:
        return None
    tower = {"siglip": "SigLIP, avg-pool projector", "pixtral": "Pixtral (2-D RoPE, any size), patch merger",
             "window_vit": "windowed ViT, patch merger",
             "mllama": f"tiled encoder + {v.global_layers} gated global layers, read by cross-attention layers "
                       f"{[i for i, s in enumerate(cfg.layers) if s.attention.kind == 'cross']}",
             "deepseek_vit": "ViT (2-D RoPE, any size), aligner, learned image start/end/newline rows; image tokens "
                             "route with bias_vl, no Engram"}[v.kind]
    size = {"siglip": f"{v.image_size}px -> {v.tokens_per_image} tokens", "pixtral": f"longest edge {v.image_size}px",
            "window_vit": f"windows of {v.window_size}px, full blocks {list(v.full_blocks)}",
            "mllama": f"up to {v.max_tiles} tiles of {v.image_size}px",
            "deepseek_vit": f"up to {v.max_image_tokens} tokens an image, at least {v.min_pixels} px"
                            + (f", wider than {v.max_wh_ratio}:1 squeezed" if v.max_wh_ratio else "")}[v.kind]
    return {"kind": v.kind, "tower": tower, "layers": v.num_layers, "hidden": v.hidden_size, "heads": v.num_heads,
            "kv_heads": v.num_kv_heads or v.num_heads, "intermediate": v.intermediate_size, "patch": v.patch_size,
            "merge": v.merge_size, "images": size, "image_token_id": v.image_token_id, "activation": v.activation,
            "parameters": sum(math.prod(s.shape) for s in plan.flatten(plan.param_specs(cfg)["vision"]).values())}


def _runs(pl, runs) -> str:
    """'8×[3×[k0], k1]': the scanned runs of the plan, by kind."""
    parts = [f"k{pl.kind_of[r.start]}" if r.body is None else f"{r.repeats}×[{_runs(pl, r.body)}]" for r in runs]
    return ", ".join(parts)


def _inspect(args) -> int:
    info = describe(args.path)
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    size = f", {info['bytes'] / 2**20:.1f} MiB" if info["bytes"] else ""
    size += " (quantized weights kept as bytes)" if info.get("kept_quantized") else ""
    print(f"{info['family']}  ({info['path']}, {info['dtype']})")
    print(f"  {info['parameters']:,} parameters{size}; vocab {info['vocab']}, hidden {info['hidden']}, "
          f"{info['heads']} heads / {info['kv_heads']} kv × {info['head_dim']}, tied head: {info['tied']}")
    print(f"  {info['layers']} layers, executed as {info['scan']}")
    for k in info["kinds"]:
        ls = k["layers"]
        print(f"  kind {k['kind']} ({len(ls)} layers: {_ranges(ls)}): attention {k['attention']}, rope {k['rope']}, "
              f"qk-norm {k['qk_norm']}, bias {k['bias']}, sinks {k['sinks']}; mlp {k['mlp']}; "
              f"block {k['block']}, norm {k['norm']}")
    if v := info["vision"]:
        print(f"  vision: {v['tower']}; {v['layers']} layers, hidden {v['hidden']}, {v['heads']} heads / "
              f"{v['kv_heads']} kv, mlp {v['activation']} I={v['intermediate']}, patch {v['patch']}, merge "
              f"{v['merge']}; {v['images']}; image token {v['image_token_id']}; {v['parameters']:,} parameters")
    return 0


def _ranges(xs: list[int]) -> str:
    if xs == list(range(xs[0], xs[-1] + 1)):
        return f"{xs[0]}-{xs[-1]}" if len(xs) > 1 else str(xs[0])
    return ",".join(map(str, xs)) if len(xs) <= 12 else ",".join(map(str, xs[:12])) + ",…"


def _generate(args) -> int:
    from jaxmodels import distributed

    distributed.initialize(args.coordinator, args.num_processes, args.process_id)  # before any JAX work
    import jax

    import jaxmodels as jm
    from jaxmodels import sharding

    mesh = sharding.make_mesh(args.mesh) if args.mesh else None
    model = jm.load(args.model, dtype=args.dtype, mesh=mesh, rules=args.rules, keep_quantized=args.keep_quantized)
    quiet = jax.process_index() != 0  # every process runs the program; one prints
    kw = dict(max_new_tokens=args.max_new_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
              min_p=args.min_p, seed=args.seed, stop=args.stop or None, chat=args.chat,
              unroll=True if args.unroll else 1, num_speculative_tokens=args.num_speculative_tokens)
    if args.image:  # read once; every prompt sees them
        from jaxmodels import images

        pictures = [images.load_image(p, f"--image {p}") for p in args.image]
        kw["images"] = [pictures] * len(args.prompt)
    out = jm.generate(model, list(args.prompt), **kw)
    # The first call includes compilation; a second, compiled run gives the tokens/s.
    warm = jm.generate(model, list(args.prompt), **kw) if args.timing else None
    if quiet:
        return 0
    for prompt, text, toks in zip(args.prompt, out.texts or [None] * len(out.tokens), out.tokens):
        print(f"> {prompt}")
        print(text if text is not None else toks)
    if warm is not None:
        n = sum(map(len, out.tokens))
        print(f"[{n} tokens; first call {out.seconds:.2f} s incl. compilation; "
              f"compiled: {warm.tokens_per_second:.1f} tokens/s]", file=sys.stderr)
    if out.acceptance_rate is not None:
        print(f"[speculative: {out.acceptance_rate:.1%} of the drafts accepted, {out.tokens_per_step:.2f} tokens a "
              f"step]", file=sys.stderr)
    return 0


def _serve(args) -> int:
    if not 0 <= args.port < 65536:
        raise ValueError(f"--port must be in [0, 65535], got {args.port}")
    if args.max_waiting < 0:
        raise ValueError(f"--max-waiting must be >= 0, got {args.max_waiting}")
    from serving.engine import Engine, EngineConfig
    from serving.runner import WARM_SAMPLING

    warm = [] if args.warmup == "none" else [w.strip() for w in args.warmup.split(",")]
    if not set(warm) <= set(WARM_SAMPLING):
        raise ValueError(f"--warmup takes 'none' or a comma-separated list of {', '.join(WARM_SAMPLING)}, "
                         f"got {args.warmup!r}")

    try:  # bad values fail here, before the model loads
        config = EngineConfig(max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
                              kv_blocks=args.kv_blocks, block_size=args.block_size,
                              max_num_batched_tokens=args.max_num_batched_tokens,
                              enable_prefix_caching=args.prefix_caching,
                              memory_fraction=args.gpu_memory_utilization,
                              async_scheduling=args.async_scheduling,
                              num_speculative_tokens=args.num_speculative_tokens)
    except ValueError as e:  # "max_num_seqs must be ..." -> "--max-num-seqs must be ..."
        field, rest = str(e).split(" ", 1)
        flag = {"memory_fraction": "gpu-memory-utilization"}.get(field, field.replace("_", "-"))
        raise ValueError(f"--{flag} {rest}") from None
    mesh = None
    if args.mesh:
        from jaxmodels import sharding

        mesh = sharding.make_mesh(args.mesh)  # a bad spec or device count: one line, before the model loads
        sharding.Sharding.of(mesh, args.rules)  # an unknown preset too
    # Bind now: a port in use is one line before minutes of loading, not an error after.
    sock = socket.create_server((args.host, args.port), family=socket.AF_INET6 if ":" in args.host else socket.AF_INET)
    import uvicorn

    import jaxmodels as jm
    from serving.api import build_app

    logging.getLogger("jaxmodels").setLevel(logging.INFO)
    model = jm.load(args.model, dtype=args.dtype, mesh=mesh, rules=args.rules, keep_quantized=args.keep_quantized)
    engine = Engine(model, config)
    if warm:  # before the address is announced: no request waits on a compile later
        print(f"warming up: compiling the engine's step shapes for {', '.join(warm)} requests ...", file=sys.stderr,
              flush=True)
        engine.warmup(warm)  # logs how many and how long
    from jaxmodels import files

    repo_id = not Path(args.model).exists() and files.REPO_ID.match(args.model)
    name = args.served_model_name or (repo_id[1] if repo_id else Path(args.model).resolve().name)
    app = build_app(engine, name, api_key=args.api_key, max_waiting=args.max_waiting)
    host, port = sock.getsockname()[:2]
    print(f"serving {name!r} on http://{host}:{port}/v1" + (" (API key required)" if args.api_key else ""),
          file=sys.stderr, flush=True)
    uvicorn.Server(uvicorn.Config(app, log_level="info", timeout_graceful_shutdown=5)).run(sockets=[sock])
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="jaxmodels", description="Open LLMs as pure JAX functions.")
    sub = p.add_subparsers(dest="cmd", required=True)

    c = sub.add_parser("convert", help="convert a checkpoint (HF dir, .gguf, PyTorch .bin) to the jaxmodels format")
    c.add_argument("src", help="HF model directory (config.json + safetensors/.bin), a .gguf file, "
                               "or ORG/NAME[@REV] in the local Hugging Face cache")
    c.add_argument("dst", help="output directory (written atomically)")
    c.add_argument("--dtype", default="bfloat16", choices=DTYPES, help="parameter dtype (default: bfloat16)")
    c.add_argument("--force", action="store_true",
                   help="replace dst if it is an earlier converted model (or an empty directory)")
    c.add_argument("--keep-quantized", action="store_true",
                   help="DeepSeek V4's FP8/FP4 weights, GPT-OSS's MXFP4 experts: keep them quantized (decoded "
                        "inside the matmul)")
    c.add_argument("--skip-mtp", action="store_true", help="DeepSeek V4: leave out the MTP / DSpark weights")
    c.set_defaults(fn=_convert)

    e = sub.add_parser("export", help="write a model back to a Hugging Face directory (safetensors, config, tokenizer)")
    e.add_argument("src", help="a converted directory or a source checkpoint (anything jm.load reads)")
    e.add_argument("hf_dir", help="output directory (written atomically), loadable with transformers")
    e.add_argument("--dtype", choices=DTYPES, help="cast the parameters (default: as converted; a source checkpoint is "
                                                   "read in float32)")
    e.add_argument("--force", action="store_true",
                   help="replace hf_dir if it is an earlier export (or an empty directory)")
    e.add_argument("--max-shard-size", default="5GB",
                   help="split model.safetensors into shards with an index above this size (bytes, or e.g. 500MB, "
                        "2GiB; default: 5GB)")
    e.set_defaults(fn=_export)

    i = sub.add_parser("inspect", help="architecture, layer plan, parameter count and bytes")
    i.add_argument("path", help="a converted directory or a source checkpoint")
    i.add_argument("--json", action="store_true", help="machine-readable output")
    i.set_defaults(fn=_inspect)

    g = sub.add_parser("generate", help="generate text")
    g.add_argument("--model", required=True, help="converted directory or source checkpoint")
    g.add_argument("--prompt", required=True, action="append", help="prompt text (repeat for a batch)")
    g.add_argument("--image", action="append", metavar="PATH",
                   help="an image every prompt sees (repeatable; vision models); a prompt without the family's "
                        "placeholder gets the images in front of its text")
    g.add_argument("--max-new-tokens", type=int, default=64)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    g.add_argument("--top-k", type=int)
    g.add_argument("--top-p", type=float)
    g.add_argument("--min-p", type=float)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--stop", action="append", help="stop string (repeatable)")
    g.add_argument("--chat", action=argparse.BooleanOptionalAction, default=True,
                   help="apply the checkpoint's chat template (default: on)")
    g.add_argument("--dtype", choices=DTYPES, help="cast parameters after loading")
    g.add_argument("--unroll", action="store_true",
                   help="unroll the decode loop over layers (longer compile; no faster since the layers read their "
                        "weights in place)")
    g.add_argument("--timing", action=argparse.BooleanOptionalAction, default=True,
                   help="run twice and report compiled tokens/s (default: on)")
    g.add_argument("--num-speculative-tokens", type=int, default=0, metavar="K",
                   help="decode speculatively with the model's own draft heads (DeepSeek V4 MTP, V4.1 DSpark), K "
                        "draft tokens a step (default: 0, off)")
    g.add_argument("--mesh", help="shard over a device mesh, e.g. 'data=2,tensor=4' (axes: data fsdp tensor expert)")
    g.add_argument("--rules", default="tp", help="sharding preset: tp | fsdp_tp | ep (default: tp)")
    g.add_argument("--coordinator", help="multi-host: address host:port of process 0")
    g.add_argument("--num-processes", type=int, help="multi-host: number of processes")
    g.add_argument("--process-id", type=int, help="multi-host: this process's index")
    g.set_defaults(fn=_generate)

    s = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API (/v1/completions, "
                                     "/v1/chat/completions, /v1/models, /health, /metrics)")
    s.add_argument("--model", required=True, help="converted directory or source checkpoint")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default: 127.0.0.1, this machine only)")
    s.add_argument("--port", type=int, default=8000)
    s.add_argument("--served-model-name", help="the name clients pass as `model` (default: the model directory's)")
    s.add_argument("--api-key", default=os.environ.get("JAXMODELS_API_KEY"),
                   help="require `Authorization: Bearer KEY` on /v1/* (default: $JAXMODELS_API_KEY; none: open)")
    s.add_argument("--max-num-seqs", type=int, default=64, help="sequences batched together (default: 64)")
    s.add_argument("--max-model-len", type=int, help="prompt + output tokens per sequence (default: the model's, "
                                                     "at most 8192)")
    s.add_argument("--kv-blocks", type=int, help="KV-cache blocks per pool (default: from device memory, see "
                                                 "--gpu-memory-utilization; on a CPU: --max-num-seqs sequences)")
    s.add_argument("--gpu-memory-utilization", type=float, metavar="FRACTION",
                   help="share of each device's memory (as JAX reports it) the server may fill, parameters included; "
                        "the KV cache gets the rest of it (default: 0.9 where the device reports its memory; refused "
                        "on a device that reports none, e.g. the CPU: use --kv-blocks)")
    s.add_argument("--block-size", type=int, default=16, help="tokens per KV-cache block (default: 16)")
    s.add_argument("--max-num-batched-tokens", type=int, default=512, help="tokens per engine step (default: 512)")
    s.add_argument("--max-waiting", type=int, default=1024,
                   help="requests queued beyond --max-num-seqs before new ones get 429 (default: 1024)")
    s.add_argument("--no-prefix-caching", dest="prefix_caching", action="store_false",
                   help="do not reuse the KV cache of common prompt prefixes")
    s.add_argument("--no-async-scheduling", dest="async_scheduling", action="store_false",
                   help="do not overlap the host's work with the device step (for comparison)")
    s.add_argument("--num-speculative-tokens", type=int, default=0, metavar="K",
                   help="decode speculatively with the model's own draft heads (DeepSeek V4 MTP, V4.1 DSpark): K "
                        "draft tokens a step, verified in one pass; /metrics reports the acceptance (default: 0, off)")
    s.add_argument("--mesh", help="shard over a device mesh, e.g. 'tensor=8' or 'data=2,tensor=4' (axes: data fsdp "
                                  "tensor expert): parameters by --rules, KV-cache pools split by kv head")
    s.add_argument("--rules", default="tp", help="sharding preset: tp | fsdp_tp | ep (default: tp)")
    s.add_argument("--dtype", choices=DTYPES, help="cast parameters after loading")
    s.add_argument("--warmup", default="greedy,sampled", metavar="KINDS",
                   help="compile every step shape before serving, for rows that are greedy, sampled and/or filtered "
                        "(top-k / top-p / min-p), comma-separated, or 'none' (default: greedy,sampled; requests with "
                        "penalties, logprobs or images still compile their step when first met)")
    s.set_defaults(fn=_serve)
    for command in (c, e):
        command.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                             help="a progress bar on stderr: bytes read / total and GB/s (default: only when stderr "
                                  "is a terminal)")
    for command in (g, s):
        command.add_argument("--keep-quantized", action="store_true",
                             help="a source checkpoint's GPT-OSS MXFP4 experts / DeepSeek FP8-FP4 weights stay "
                                  "quantized in memory (~0.27 of bf16; decoded inside the GPU matmul kernels)")
    for command in (c, e, i, g, s):
        command.add_argument("--debug", action="store_true", help="show the full trace of an error")
    return p


def main(argv=None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parser().parse_args(argv)
    try:
        return args.fn(args)
    except KeyboardInterrupt:
        print(f"jaxmodels {args.cmd}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # every failure a user can cause is one line; --debug shows where it came from
        if args.debug:
            traceback.print_exc()
        print(f"jaxmodels {args.cmd}: error: {_one_line(e)}", file=sys.stderr)
        return 2


def _one_line(e: Exception) -> str:
    if isinstance(e, OSError) and e.filename is not None:  # "[Errno 30] Read-only file system: 'x'" -> "x: ..."
        return f"{e.filename}: {e.strerror or e}"
    text = " ".join(str(e).split()) or "(no message)"
    if isinstance(e, (ValueError, OSError, NotImplementedError)):  # ours, or the OS: the message says it all
        return text
    return f"{type(e).__name__}: {text} (an unexpected failure; --debug shows the trace)"


if __name__ == "__main__":
    sys.exit(main())
