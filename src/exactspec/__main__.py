import sys

from exactspec.launch import main

sys.exit(main())
