import sys

from services.cli import main

main(["ps", *sys.argv[1:]])
