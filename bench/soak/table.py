"""The table of what a bad or refused request gets (docs/requests.md), from soak summaries: one row per request kind
and server, with the status and one message the soak observed (values in messages vary with the request).

    python3 -m bench.soak.table OUT/summary.json [MORE/summary.json ...]
"""

from __future__ import annotations

import json
import sys

# What each kind sends (bench.soak.mix), as a user would write it.
SENT = {
    "penalties": "`presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.1`",
    "structured_outputs": "`structured_outputs={\"choice\": [\"yes\", \"no\"]}` (chat)",
    "response_format": "`response_format={\"type\": \"json_object\"}` (chat)",
    "thinking_budget": "`thinking_token_budget=4` (chat)",
    "empty_prompt": "`prompt=\"\"`",
    "empty_chat": "a chat message with empty content",
    "too_long_prompt": "a prompt longer than `max_model_len`",
    "bad_temperature": "`temperature=-1`",
    "bad_top_p": "`top_p=1.5`",
    "bad_n": "`n=0`",
    "bad_max_tokens": "`max_tokens=-1`",
    "bad_logprobs": "`logprobs=1000` (over vLLM's `max_logprobs`, 20)",
    "bad_model": "`model` not the served one",
}
SERVERS = {"chain": "reconstruct chain (k = 3)", "tree": "[2,2,1] tree"}


def rows(summaries: list[dict]) -> list[tuple[str, str, str, str]]:
    """(sent, server, status, message) for every refused kind, and "accepted" rows for the kinds a server took; the
    server names its platform (a `--gpu` soak runs vLLM's default runner on CUDA, Model Runner V2)."""
    out = {}
    for summary in summaries:
        platform = "CUDA, Model Runner V2" if summary.get("args", {}).get("gpu") else "CPU, V1 runner"
        for result in summary["strategies"]:
            server = f"{SERVERS[result['strategy']]} ({platform})"
            for refusal in result.get("refusals", []):
                message = refusal["message"].removeprefix(f"Error code: {refusal['status']} - ")
                out.setdefault((refusal["kind"], server), (str(refusal["status"]), message))
            for kind in result.get("by_kind", {}):
                if kind in SENT:
                    out.setdefault((kind, server), ("200", "accepted"))
    order = list(SENT)
    return [(SENT[kind], server, status, message)
            for (kind, server), (status, message) in sorted(out.items(), key=lambda kv: (order.index(kv[0][0]),
                                                                                        kv[0][1]))]


def markdown(summaries: list[dict]) -> str:
    lines = ["| request | server | status | message |", "| --- | --- | --- | --- |"]
    lines += [f"| {sent} | {server} | {status} | {message.replace('|', '/')} |"
              for sent, server, status, message in rows(summaries)]
    return "\n".join(lines)


def main(argv=None) -> int:
    paths = sys.argv[1:] if argv is None else argv
    print(markdown([json.loads(open(p).read()) for p in paths]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
