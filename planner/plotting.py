"""matplotlib for `--plot`: optional (the `plot` extra), headless, and its failures one-line errors."""
from __future__ import annotations

from pathlib import Path

from planner.errors import PlanError


def pyplot(complete: str):
    """matplotlib.pyplot on the Agg backend; PlanError when it is not installed (`complete`: what
    the user already has without the plot, for the message)."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlanError(f"--plot needs matplotlib, which is not installed (pip install 'helm[plot]' or pip install "
                        f"matplotlib); {complete}") from None
    return plt


def save(fig, out: str | Path) -> None:
    """Write the figure as a PNG and free it; PlanError when the file cannot be written."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    try:
        fig.savefig(out, dpi=120)
    except OSError as e:
        raise PlanError(f"--plot: cannot write {out}: {e.strerror or e}") from None
    finally:
        plt.close(fig)
