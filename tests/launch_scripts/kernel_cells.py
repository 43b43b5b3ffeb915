"""Run a file's text as a notebook cell in a fresh Jupyter kernel, as a JupyterLab in a
batch job runs its cells (Open OnDemand's way), and print what the cell printed.

    python tests/launch_scripts/kernel_cells.py tests/launch_scripts/where_am_i.py
"""

import sys
from pathlib import Path

from nbclient import NotebookClient
from nbformat.v4 import new_code_cell, new_notebook

if __name__ == "__main__":
    notebook = new_notebook(metadata={"kernelspec": {
        "name": "python3", "language": "python", "display_name": "Python 3"}})
    notebook.cells = [new_code_cell(Path(sys.argv[1]).read_text())]
    NotebookClient(notebook, timeout=180, kernel_name="python3").execute()
    for output in notebook.cells[0].outputs:
        if output.output_type == "stream" and output.name == "stdout":
            sys.stdout.write(output.text)
