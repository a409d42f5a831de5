"""Checks the workspace's rust-version against its dependencies' (cargo metadata on stdin).

The toolchain on CI is newer than the declared rust-version and no other can be fetched, so the
declaration is checked two ways: here, that no dependency in Cargo.lock needs a newer Rust; and
by clippy's `incompatible_msrv` (in .ci/run), that no standard-library item newer than it is used.
"""
import json
import sys


def version(text):
    parts = [int(x) for x in text.split(".")]
    return tuple(parts + [0] * (3 - len(parts)))


meta = json.load(sys.stdin)
ours = {p["name"]: p["rust_version"] for p in meta["packages"] if p["source"] is None}
declared = set(ours.values())
if len(declared) != 1:
    sys.exit(f"the crates declare different rust-versions: {ours}")
declared = declared.pop()
deps = [p for p in meta["packages"] if p["source"] and p.get("rust_version")]
needs = max(deps, key=lambda p: version(p["rust_version"]))
name, v, rv = needs["name"], needs["version"], needs["rust_version"]
if version(rv) > version(declared):
    sys.exit(f"rust-version {declared} is older than what {name} {v} needs ({rv})")
print(f"rust-version {declared}: the newest any dependency needs is {rv} ({name} {v})")
