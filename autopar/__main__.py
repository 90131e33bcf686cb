from autopar.cli import run

run()
