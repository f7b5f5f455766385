"""`pagedserve generate` (one-shot) and `pagedserve chat` (interactive)."""

from __future__ import annotations

import argparse
import sys

from pagedserve.entrypoints.engine_args import add_engine_args, engine_config_from_args


def register(sub) -> None:
    generate = sub.add_parser("generate", help="generate a completion for one or more prompts")
    generate.add_argument("--prompt", action="append", required=True, help="prompt text (repeat for several)")
    _add_sampling_args(generate)
    add_engine_args(generate)
    generate.set_defaults(handler=run_generate)

    chat = sub.add_parser("chat", help="interactive chat with the model's chat template")
    chat.add_argument("--system", default=None, help="system message")
    _add_sampling_args(chat, default_max_tokens=512)
    add_engine_args(chat)
    chat.set_defaults(handler=run_chat)


def _add_sampling_args(parser: argparse.ArgumentParser, default_max_tokens: int = 128) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=default_max_tokens, help="most tokens to generate (default: %(default)s)")
    group.add_argument("--temperature", type=float, default=0.0,
                       help="sampling temperature; 0 picks the most likely token (default: %(default)s)")
    group.add_argument("--top-p", type=float, default=1.0,
                       help="sample from the smallest set of tokens whose probability reaches this (default: %(default)s)")
    group.add_argument("--top-k", type=int, default=0, help="sample from the k most likely tokens; 0: all (default: %(default)s)")
    group.add_argument("--min-p", type=float, default=0.0,
                       help="drop tokens less likely than this times the most likely one's probability (default: %(default)s)")
    group.add_argument("--repetition-penalty", type=float, default=1.0,
                       help="divide the logits of tokens already in the prompt or output by this; 1: off (default: %(default)s)")
    group.add_argument("--presence-penalty", type=float, default=0.0,
                       help="subtract this from the logits of tokens already generated (default: %(default)s)")
    group.add_argument("--frequency-penalty", type=float, default=0.0,
                       help="subtract this times a token's count so far from its logit (default: %(default)s)")
    group.add_argument("--stop", action="append", default=None, help="stop at this string; repeat for several (default: none)")
    group.add_argument("--n", type=int, default=1, help="completions per prompt (default: %(default)s)")


def _sampling_params(args):
    from pagedserve.sampling_params import SamplingParams

    return SamplingParams(
        n=args.n, max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty, stop=args.stop,
    )


def _make_llm(args):
    from pagedserve.engine.llm import LLM

    return LLM.from_config(engine_config_from_args(args))


def run_generate(args) -> int:
    params = _sampling_params(args)
    llm = _make_llm(args)
    outputs = llm.generate(args.prompt, params, use_tqdm=False)
    for output in outputs:
        for completion in output.outputs:
            prefix = f"[{completion.index}] " if len(output.outputs) > 1 else ""
            print(f"{prefix}{output.prompt}{completion.text}")
            print(f"  ({len(completion.token_ids)} tokens, finish_reason={completion.finish_reason})", file=sys.stderr)
    return 0


def run_chat(args) -> int:
    params = _sampling_params(args)
    llm = _make_llm(args)
    history = [{"role": "system", "content": args.system}] if args.system else []
    print("Chat with the model. Empty line or Ctrl-D to quit.", file=sys.stderr)
    while True:
        try:
            line = input("> ")
        except EOFError:
            break
        if not line.strip():
            break
        history.append({"role": "user", "content": line})
        reply = llm.chat(history, params, use_tqdm=False)[0].outputs[0].text
        print(reply)
        history.append({"role": "assistant", "content": reply})
    return 0
