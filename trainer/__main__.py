import sys

from services.cli import main

main(["trainer", *sys.argv[1:]])
