"""What the commands that run on several ranks share: the workers' command line, rebuilt from the options given."""

from __future__ import annotations

from ..errors import OomtuneError


def flags(**values) -> list[str]:
    """Options given (not None, not False) back as command-line flags, for the workers' command line."""
    args: list[str] = []
    for name, v in values.items():
        flag = "--" + name.replace("_", "-")
        if v is None or v is False:
            continue
        if v is True:
            args.append(flag)
        elif isinstance(v, list):
            for item in v:
                args += [flag, str(item)]
        else:
            args += [flag, str(v)]
    return args


def parse_rank_budgets(values: list[str] | None) -> dict[int, str]:
    """--rank-budget RANK=BUDGET (repeatable) -> {rank: budget}."""
    budgets = {}
    for v in values or []:
        rank, sep, budget = v.partition("=")
        if not sep or not rank.strip().isdigit() or not budget.strip():
            raise OomtuneError(f"--rank-budget {v!r}: expected RANK=BUDGET, e.g. 1=8MiB")
        budgets[int(rank)] = budget.strip()
    return budgets
