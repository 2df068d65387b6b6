#!/usr/bin/env bash
# Re-fetch the KaTeX that `kvrescue view` inlines into its page (kvrescue/view/katex/) from the npm
# registry: the pinned version's tarball, checked against its SHA-256, unpacked, and only what the page needs
# copied (katex.min.js, katex.min.css, the woff2 fonts, LICENSE). The same version gives the same files.
#   bash scripts/vendor_katex.sh            # the pinned version
#   KATEX_VERSION=0.19.2 KATEX_SHA256=... bash scripts/vendor_katex.sh   # another one (then update the pins here)
set -euo pipefail
version="${KATEX_VERSION:-0.19.1}"
sha256="${KATEX_SHA256:-24da5a599eb2fcede2e270b99a6ff48bca816beecc95feeb84e8cccbd1bb34fd}"
url="https://registry.npmjs.org/katex/-/katex-${version}.tgz"
dest="$(cd "$(dirname "$0")/.." && pwd)/kvrescue/view/katex"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
curl -fsSL -o "$tmp/katex.tgz" "$url"
echo "${sha256}  $tmp/katex.tgz" | sha256sum -c --quiet
tar -xzf "$tmp/katex.tgz" -C "$tmp"
rm -rf "$dest"
mkdir -p "$dest/fonts"
cp "$tmp/package/dist/katex.min.js" "$tmp/package/dist/katex.min.css" "$tmp/package/LICENSE" "$dest/"
cp "$tmp"/package/dist/fonts/*.woff2 "$dest/fonts/"
cat > "$dest/README.md" <<README
KaTeX ${version} (MIT, see LICENSE), inlined by \`kvrescue view\` into its page: katex.min.js, katex.min.css and
the woff2 fonts of ${url}
(SHA-256 ${sha256}). Written by scripts/vendor_katex.sh; do not edit by hand.
README
echo "KaTeX ${version} -> ${dest}"
