"""The paper: `python -m paper.generate` writes paper/generated/ from results/; `bash paper/build.sh` builds the PDF."""
