#!/usr/bin/env bash
# Build paper/build/main.pdf: Debian TeX packages if missing, the generated tables from results/,
# then pdflatex + bibtex.
#
#   bash paper/build.sh          (or: make paper)
#   bash paper/build.sh --yes    (or: PAPER_INSTALL=yes make paper) install missing TeX packages without asking
#
# Missing Debian packages are installed with apt-get only with consent: --yes or PAPER_INSTALL=yes, or a "y"
# to the question asked when stdin is a terminal. Otherwise (CI, a pipe, PAPER_INSTALL=no, or any other answer)
# the script prints the apt-get command to run and exits with status 1, changing nothing on the system.
set -euo pipefail
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
cd "$ROOT"

assume_yes=0
for arg in "$@"; do
    case "$arg" in
        -y|--yes) assume_yes=1 ;;
        -h|--help) sed -n '2,10p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "paper/build.sh: unknown argument '$arg' (usage: bash paper/build.sh [--yes])" >&2; exit 2 ;;
    esac
done
case "${PAPER_INSTALL:-}" in
    yes) assume_yes=1 ;;
    no) assume_yes=-1 ;;  # never install, never ask (nothing changes on the system)
esac

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
    SUDO=""
    if [ "$(id -u)" -ne 0 ]; then SUDO="sudo"; fi
    install_cmd="${SUDO:+$SUDO }apt-get install --no-install-recommends ${need[*]}"
    echo "paper/build.sh: the PDF needs these Debian packages, which are missing: ${need[*]}" >&2
    # Installing system packages changes the machine, so it needs consent: asked on a terminal, given
    # in advance with --yes or PAPER_INSTALL=yes; never assumed (a CI job or a pipe gets the command instead).
    if [ "$assume_yes" -eq 0 ] && [ -t 0 ]; then
        read -r -p "paper/build.sh: run '$install_cmd' now? [y/N] " answer || answer=""
        case "$answer" in [yY]|[yY][eE][sS]) assume_yes=1 ;; esac
    fi
    if [ "$assume_yes" -ne 1 ]; then
        echo "paper/build.sh: not installing system packages without consent. Install them with" >&2
        echo "    $install_cmd" >&2
        echo "(after '${SUDO:+$SUDO }apt-get update' if apt-get cannot find them), or let this script run it:" >&2
        echo "    PAPER_INSTALL=yes make paper     or     bash paper/build.sh --yes" >&2
        exit 1
    fi
    if [ -n "$SUDO" ] && ! command -v sudo >/dev/null 2>&1; then
        echo "paper/build.sh: need root (or sudo) to install ${need[*]}" >&2
        exit 1
    fi
    echo "paper/build.sh: installing ${need[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    # An explicit `if !`: set -e alone does not stop the script when the `apt-get update` inside `|| { ... }` fails.
    if ! { $SUDO apt-get install -y -q --no-install-recommends "${need[@]}" \
            || { $SUDO apt-get update -q && $SUDO apt-get install -y -q --no-install-recommends "${need[@]}"; }; }; then
        echo "paper/build.sh: apt-get could not install ${need[*]} (see above)" >&2
        exit 1
    fi
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
