"""``python tests/dflash_with_fault.py SPEC ARGS...``: dflash_train's command line with a fault armed (SPEC as
``dflash_train.faults.arm`` takes it: 'raise@drafter:2', 'hang@target:0'), for the tests of the error paths. A
script, not ``-c`` code, so that torchrun can start it on every rank."""

import sys

from dflash_train import faults
from dflash_train.__main__ import main

faults.arm(sys.argv[1])
sys.exit(main(sys.argv[2:]))
