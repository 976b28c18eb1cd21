"""`supervisor completion bash|zsh`: a completion script made from the parser itself, so
it offers exactly the commands and options this version has; node and job names are
asked of the server (`supervisor get nodes -o name`), and so are the ids of maintenance
windows and drills, with the context's server and token, as kubectl's completion does.

    source <(supervisor completion bash)        # bash, or in ~/.bashrc
    source <(supervisor completion zsh)         # zsh (through its bashcompinit)
"""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Iterator
from typing import Any

from supervisor.ops.errors import EXIT_CODES_HELP

#: Command paths whose free argument is a node or a job name.
NODE_ARGS = ("describe node", "describe nodes", "cordon", "uncordon", "get nodes", "get node")
JOB_ARGS = ("describe job", "describe jobs", "get jobs", "get job", "reset-budget")
#: ... a maintenance window's id, under each of the resource's names; a drill's.
WINDOW_ARGS = tuple(
    f"{verb} {name}"
    for verb in ("get", "describe", "delete")
    for name in ("maintenance", "maintenance-windows", "maintenance-window", "mw")
)
DRILL_ARGS = ("get drills", "get drill", "delete drill", "delete drills")

_FUNCTION = r"""
# zsh (bashcompinit) numbers arrays from 1, bash from 0.
_supervisor_at() {
  local base=0
  [[ -n ${ZSH_VERSION-} ]] && base=1
  printf '%s' "${COMP_WORDS[$(($1 + base))]}"
}

# The words of $1 that start with $2 (zsh's compgen does not filter).
_supervisor_reply() {
  COMPREPLY=()
  local line
  while IFS= read -r line; do
    [[ -n "$line" && "$line" == "$2"* ]] && COMPREPLY+=("$line")
  done < <(compgen -W "$1" -- "$2")
}

_supervisor_names() {
  local what="$1" w i prev=""
  local -a conn=()
  for ((i=1; i<${#COMP_WORDS[@]}; i++)); do
    w="$(_supervisor_at $i)"
    case "$prev" in
      --server|--url|--token|--context|--config|--certificate-authority|--tls-server-name)
        conn+=("$prev" "$w");;
    esac
    prev="$w"
  done
  "$(_supervisor_at 0)" get "$what" -o name --no-headers --timeout 3 "${conn[@]}" 2>/dev/null \
    | sed "s|^[a-z]*/||"
}

_supervisor_complete() {
  # Not `path`: zsh ties that name to PATH.
  local cur prev="" at="supervisor" word key i
  cur="$(_supervisor_at $COMP_CWORD)"
  ((COMP_CWORD > 0)) && prev="$(_supervisor_at $((COMP_CWORD - 1)))"
  for ((i=1; i<COMP_CWORD; i++)); do
    word="$(_supervisor_at $i)"
    key="$at $word"
    if [[ -n "${_supervisor_words[$key]+set}" ]]; then
      at="$key"
    fi
  done
  key="$at|$prev"
  if [[ -n "${_supervisor_words[$key]+set}" ]]; then
    _supervisor_reply "${_supervisor_words[$key]}" "$cur"
    return
  fi
  if [[ "$cur" != -* && -n "${_supervisor_names[$at]+set}" ]]; then
    _supervisor_reply "$(_supervisor_names "${_supervisor_names[$at]}")" "$cur"
    ((${#COMPREPLY[@]})) && return
  fi
  _supervisor_reply "${_supervisor_words[$at]}" "$cur"
}
"""


def add_command(sub: Any) -> None:
    command = sub.add_parser(
        "completion",
        epilog=EXIT_CODES_HELP,
        help="Print a shell completion script: source <(supervisor completion bash).",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.add_argument("shell", choices=("bash", "zsh"))
    command.set_defaults(offline_handler=lambda args: print(script(sub, args.shell), end=""))


def script(sub: Any, shell: str) -> str:
    """The script for `shell`, from the subcommands in `sub` (the subparsers action)."""
    words: dict[str, list[str]] = {}
    _walk("supervisor", sub, words)
    lines = ["# supervisor shell completion (supervisor completion " + shell + ")"]
    if shell == "zsh":
        lines.append("autoload -U +X bashcompinit && bashcompinit")
    lines.append(_FUNCTION.strip("\n"))
    lines.append("declare -A _supervisor_words=(")
    lines += [f"  [{shlex.quote(k)}]={shlex.quote(' '.join(v))}" for k, v in words.items()]
    lines.append(")")
    lines.append("declare -A _supervisor_names=(")
    lines += [f"  [{shlex.quote('supervisor ' + p)}]=nodes" for p in NODE_ARGS]
    lines += [f"  [{shlex.quote('supervisor ' + p)}]=jobs" for p in JOB_ARGS]
    lines += [f"  [{shlex.quote('supervisor ' + p)}]=maintenance" for p in WINDOW_ARGS]
    lines += [f"  [{shlex.quote('supervisor ' + p)}]=drills" for p in DRILL_ARGS]
    lines.append(")")
    lines.append("complete -F _supervisor_complete supervisor")
    return "\n".join(lines) + "\n"


def _walk(path: str, sub: Any, words: dict[str, list[str]]) -> None:
    words[path] = sorted(sub.choices)
    for name, parser in sub.choices.items():
        here = f"{path} {name}"
        words[here] = []
        for action in parser._actions:
            if isinstance(action, argparse._SubParsersAction):
                _walk(here, action, words)
                words[here] = sorted(action.choices)
                continue
            words[here] += action.option_strings
            for option, values in _values(action):
                words[f"{here}|{option}"] = values


def _values(action: argparse.Action) -> Iterator[tuple[str, list[str]]]:
    """What an option takes, where it is a fixed set (choices; -o's formats)."""
    if action.dest == "output" and action.choices is None:
        values = ["table", "wide", "name", "json", "yaml", "jsonpath="]
    elif action.choices is not None and action.option_strings:
        values = [str(c) for c in action.choices]
    else:
        return
    for option in action.option_strings:
        yield option, values
