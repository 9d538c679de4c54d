"""``lab evidence verify|show``: verify a run's, a model run's or a reproduction's evidence.

Which keys count comes from ``lab.evidence.trust`` (the default branch's tip, its
revocations, and a ``--public-key`` pin); what verifies comes from the verifier of each
kind of evidence. This module only picks the kind and prints the verdict.
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

from lab import errors
from lab.options import option


@dataclasses.dataclass(frozen=True)
class EvidenceOptions:
    """What ``lab evidence verify|show`` is asked to do: the subcommand and its flags."""

    evidence_command: str
    path: str = option("evidence", help="evidence directory or envelope file", positional=True)
    public_key: str | None = option(
        None, help="PEM of the expected signer (the only key accepted)")
    check_sources: bool = option(
        False, help="compare every signed digest and the manifest with this tree")


def verify_main(options: EvidenceOptions) -> int:
    """``lab evidence verify|show``: both verify; 0 only when the evidence verifies.

    ``show`` also needs a PASS to exit 0, and says what it could not verify.
    """
    from lab.evidence import dsse, gate, summary, trust, verification

    path = Path(options.path)
    root = Path.cwd()
    pinned = None
    if options.public_key:
        pinned = dsse.load_public_key_file(Path(options.public_key), "--public-key")
    from lab.model import signed

    # The keys at the tip of the default branch, and its revocations: passed even with
    # --public-key, so that a revoked key is refused however it is named.
    trusted = trust.trusted_keys(root)
    if options.evidence_command == "verify" and signed.is_model_evidence(path):
        model_verdict = signed.verify(path, public_key=pinned, trusted=trusted)
        print(signed.format_verdict(model_verdict))
        sys.stdout.flush()
        return 0 if model_verdict.ok else 1
    from lab.evidence import reproduction_evidence

    if options.evidence_command == "verify" and path.is_dir() and \
            reproduction_evidence.is_reproduction(path):
        checked = reproduction_evidence.verify(path, public_key=pinned, trusted=trusted)
        print(reproduction_evidence.format_verdict(checked))
        sys.stdout.flush()
        return 0 if checked.ok else 1
    verdict = verification.verify(
        path,
        public_key=pinned,
        trusted=trusted,
        check_sources=options.check_sources,
        root=root,
    )
    if verdict.unreadable is not None:
        raise errors.InputError(verification.printable(verdict.unreadable))
    if options.evidence_command == "show":
        if verdict.report is None:
            # Nothing trustworthy in shape to show: the first problem names the file.
            problem = verdict.problems[0] if verdict.problems else f"{path}: no report"
            raise errors.InputError(verification.printable(problem))
        print(verification.format_verdict(verdict))
        summary.print_summary(verdict.report, verdict.envelope.parent)
        for what in verdict.unverified():
            print(f"not verified: {what}")
        code = 0 if verdict.ok and verdict.report["status"] == gate.PASS else 1
    else:
        print(verification.format_verdict(verdict))
        code = 0 if verdict.ok else 1
    # Flush here, inside main's handling: a closed stdout (``| head -1``) becomes a
    # BrokenPipeError that main handles, not a traceback at interpreter exit.
    sys.stdout.flush()
    return code
