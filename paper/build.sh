#!/usr/bin/env bash
# Build paper/build/main.pdf: Debian TeX packages if missing, the generated tables from results/,
# then pdflatex + bibtex. Usage: bash paper/build.sh   (or: make paper)
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

# 1. TeX. Each entry: a file the build needs, and the Debian package that provides it.
need=()
check() {  # check <kpsewhich file | command:NAME> <package>
    case "$1" in
        command:*) command -v "${1#command:}" >/dev/null 2>&1 || need+=("$2") ;;
        *) { command -v kpsewhich >/dev/null 2>&1 && [ -n "$(kpsewhich "$1")" ]; } || need+=("$2") ;;
    esac
}
check command:pdflatex texlive-latex-base
check command:bibtex texlive-binaries
check geometry.sty texlive-latex-base
check natbib.sty texlive-latex-base
check hyperref.sty texlive-latex-base
check booktabs.sty texlive-latex-recommended
check microtype.sty texlive-latex-recommended
check xcolor.sty texlive-latex-recommended
check caption.sty texlive-latex-recommended
check pgfplots.sty texlive-pictures
check lmodern.sty lmodern
check t1lmr.fd lmodern
check plainnat.bst texlive-latex-base
if [ ${#need[@]} -gt 0 ]; then
    mapfile -t need < <(printf '%s\n' "${need[@]}" | sort -u)
    echo "paper/build.sh: installing ${need[*]}" >&2
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then
        command -v sudo >/dev/null 2>&1 || { echo "paper/build.sh: need root (or sudo) to install ${need[*]}" >&2; exit 1; }
        SUDO="sudo"
    fi
    export DEBIAN_FRONTEND=noninteractive
    $SUDO apt-get install -y -q --no-install-recommends "${need[@]}" \
        || { $SUDO apt-get update -q && $SUDO apt-get install -y -q --no-install-recommends "${need[@]}"; }
fi

# 2. The tables and figures, from the committed results.
if [ -x "$ROOT/.venv/bin/python" ]; then PY="$ROOT/.venv/bin/python"; else PY="python3"; fi
"$PY" -m paper.generate

# 3. LaTeX, run from paper/ so that generated/ and references.bib resolve; output in paper/build/.
cd "$ROOT/paper"
mkdir -p build
latex() {
    if ! pdflatex -interaction=nonstopmode -halt-on-error -file-line-error -output-directory=build main.tex \
            >build/pdflatex.out 2>&1; then
        grep -A3 -E '^(\./)?[^:]+:[0-9]+:|^!' build/pdflatex.out | head -40 >&2 || tail -40 build/pdflatex.out >&2
        echo "paper/build.sh: pdflatex failed; full log in paper/build/main.log" >&2
        exit 1
    fi
}
latex
bibtex build/main >build/bibtex.out 2>&1 || { cat build/bibtex.out >&2; echo "paper/build.sh: bibtex failed" >&2; exit 1; }
latex
latex
if grep -qE 'LaTeX Warning: (Reference|Citation).*undefined' build/main.log; then
    grep -E 'LaTeX Warning: (Reference|Citation).*undefined' build/main.log >&2
    echo "paper/build.sh: undefined references (see above)" >&2
    exit 1
fi
echo "paper/build.sh: wrote paper/build/main.pdf"
