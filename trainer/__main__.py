import sys

from supervise.cli import main

main(["trainer", *sys.argv[1:]])
