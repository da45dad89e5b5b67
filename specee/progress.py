"""Progress bars, drawn on a terminal only: redirected to a log or a pipe, stderr would collect every
carriage-return frame of the bar."""
from __future__ import annotations

import sys

from tqdm import tqdm


def progress_bar(iterable=None, enabled: bool = True, **kw) -> tqdm:
    """A tqdm bar on stderr; disabled (updates do nothing, an iterable passes through) unless `enabled`
    and stderr is a terminal."""
    return tqdm(iterable, disable=not (enabled and sys.stderr.isatty()), file=sys.stderr, dynamic_ncols=True, **kw)
