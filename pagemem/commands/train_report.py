"""What ``pagemem train`` prints: a log line every ``train.log_every`` steps, and the summary table."""

from __future__ import annotations

from typing import Any

from pagemem.units import format_bytes


def log_line(m: dict[str, Any]) -> str:
    """One metrics line in words (with several ranks, a log step's holds each rank's too)."""
    moved = m["moved_bytes_per_s"]
    host = sum(v for k, v in moved.items() if "nvme" not in k)
    nvme = sum(v for k, v in moved.items() if "nvme" in k)
    gn = f"{m['grad_norm']:.3f}" if m["grad_norm"] is not None else "-"
    lr = f"  lr {m['lr']:.2e}" if m.get("lr") is not None else ""
    val = f"  val loss {m['val_loss']:.4f}" if m.get("val_loss") is not None else ""
    line = (f"step {m['step']:>6}  loss {m['loss']:.4f}{val}  grad norm {gn}{lr}  {m['tokens_per_s']:,.0f} tok/s  "
            f"gpu peak {format_bytes(m['gpu_peak_bytes'])} / {format_bytes(m['gpu_budget_bytes'])}  "
            f"host {format_bytes(int(host))}/s  nvme {format_bytes(int(nvme))}/s  gpu idle {100 * m['gpu_idle']:.0f}%")
    if m["staleness_mean"] is not None:
        line += f"  staleness {m['staleness_mean']:.2f}"
    for r in m.get("ranks", ()):
        line += f"  | rank {r['rank']} {_tokens(r['tokens_per_s'])}, sent {format_bytes(r['sent_bytes'])}"
    return line


def _tokens(per_s: float | None) -> str:
    return "-" if per_s is None else f"{per_s:,.0f} tok/s"


def summary_table(s: dict[str, Any]) -> str:
    """The summary (``summary.json``) as a table."""
    def b(n: int | None) -> str:
        return "-" if n is None else format_bytes(int(n))

    floor = f" (floor {s['loss_floor']:.4f})" if s.get("loss_floor") is not None else ""
    ending = " (interrupted)" if s["interrupted"] else (" (stopped: diverging)" if "diverging" in (s.get("stopped") or "")
                                                   else " (stopped: not finite or above max_loss)" if s.get("stopped") else "")
    rows = [("run directory", s["run_dir"]),
            ("steps", f"{s['steps_done']} of {s['steps']}{ending}"),
            ("wall time", f"{s['wall_seconds']:,.1f} s" if s.get("wall_seconds") is not None else "-"),
            ("throughput", f"{s['tokens_per_s']:,.0f} tokens/s" if s["tokens_per_s"] else "-"),
            ("loss, first 10 -> last 10 steps",
             f"{s['first_loss']:.4f} -> {s['last_loss']:.4f}{floor}" if s["first_loss"] is not None else "-")]
    if s.get("val_loss") is not None:
        rows.append(("validation loss (perplexity)", f"{s['val_loss']:.4f} ({s['val_perplexity']:,.2f})"
                     if s.get("val_perplexity") is not None else f"{s['val_loss']:.4f}"))
    session = s.get("session_steps", s["steps_done"])
    if s.get("homes"):  # [Note: homes on nvme]: where the training state lives at rest
        rows.append(("homes", ", ".join(f"{what} on {tier}" for what, tier in s["homes"].items())))
    for tier, peak in s["peak_bytes"].items():
        rows.append((f"peak {tier}", f"{b(peak)} of {b(s['budget_bytes'].get(tier))}"))
    for direction, n in sorted(s["moved_bytes"].items()):
        if n:
            rows.append((f"moved {direction}" + (f" ({session} steps of this session)" if session != s["steps_done"]
                                                  else ""), b(n)))
    if s.get("world_size", 1) > 1:
        rows.append(("ranks", f"{s['world_size']}: " + "; ".join(
            f"rank {r['rank']} {_tokens(r['tokens_per_s'])}, sent {b(r['sent_bytes'])}" for r in s["ranks"])))
    rows.append(("gpu idle", f"{100 * s['gpu_idle']:.1f}%"))
    rows.append(("re-plans", str(s["replans"])))
    if s["staleness"]:
        rows.append(("staleness mean / max", f"{s['staleness']['mean']:.2f} / {s['staleness']['max']}"))
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
