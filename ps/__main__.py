import sys

from supervise.cli import main

main(["ps", *sys.argv[1:]])
