#!/usr/bin/env bash
# dev/sass_diff_b.sh - compares the device code of two builds of the cuda plugin kernel by kernel:
# the SASS of every function (cuobjdump -sass) and its resource usage (cuobjdump -res-usage), split
# per function and normalized (instruction addresses dropped; the per-file prefix of names in an
# anonymous namespace and of static functions dropped; functions sorted by name), so that moving
# kernels between .cu files, or reordering them, compares equal while any change to a kernel's
# instructions, registers, shared memory, stack or launch bounds does not.
#
#   dev/sass_diff_b.sh OLD.so|OLD.a|OLD.o NEW.so|NEW.a|NEW.o [WORKDIR]
#
# Prints one line per function: "same NAME", "differs NAME" (instructions), "resources NAME | OLD -> NEW"
# (the same instructions, other resource usage), "only-old NAME", "only-new NAME", then a count; exits 0 when every function is the same and both sides have the same set.
# Needs cuobjdump and nvdisasm on PATH (or CUOBJDUMP=...). Not part of the build.
set -euo pipefail
old=$1 new=$2 work=${3:-$(mktemp -d)}
CUOBJDUMP=${CUOBJDUMP:-cuobjdump}
mkdir -p "$work"
if [ -z "${SASS_DIFF_REUSE:-}" ]; then # set: compare the dumps already in WORKDIR
  "$CUOBJDUMP" -sass "$old" > "$work/old.sass"
  "$CUOBJDUMP" -sass "$new" > "$work/new.sass"
  "$CUOBJDUMP" -res-usage "$old" > "$work/old.res" 2>/dev/null || true
  "$CUOBJDUMP" -res-usage "$new" > "$work/new.res" 2>/dev/null || true
fi
python3 - "$work" <<'PY'
import re, sys, os
work = sys.argv[1]

def norm_name(n):
    # _ZN<len>_GLOBAL__N__<hash>_<n>_<file>_<hash><rest>: drop the namespace's <len> characters
    out, i = [], 0
    while True:
        m = re.compile(r'(\d+)_GLOBAL__N__').search(n, i)
        if not m:
            break
        ln = int(m.group(1))
        out.append(n[i:m.start()] + '<anon>')
        i = m.start() + len(m.group(1)) + ln
    out.append(n[i:])
    n = ''.join(out)
    n = re.sub(r'__nv_static_\d+__[0-9a-f]+_', '<static>_', n)
    return n

def split_sass(path):
    funcs, cur, body = {}, None, []
    for line in open(path, errors='replace'):
        m = re.match(r'\s*Function : (\S+)', line)
        if m:
            if cur: funcs.setdefault(cur, []).append(body)
            cur, body = norm_name(m.group(1)), []
            continue
        if cur is None: continue
        if not re.match(r'\s*/\*[0-9a-f]{4,}\*/', line):  # instructions only (not the fatbin headers)
            continue
        s = re.sub(r'/\*[0-9a-f]{4,}\*/', '', line)       # address
        s = re.sub(r'/\* 0x[0-9a-f]{16} \*/', '', s)     # encoding (its text is compared)
        s = re.sub(r'_Z\w+', lambda m: norm_name(m.group(0)), s)
        s = ' '.join(s.split())
        if s: body.append(s)
    if cur: funcs.setdefault(cur, []).append(body)
    return funcs

def split_res(path):
    res, cur = {}, None
    if not os.path.exists(path): return res
    for line in open(path, errors='replace'):
        m = re.match(r'\s*Function (\S+):', line)
        if m:
            cur = norm_name(m.group(1)); continue
        if cur and line.strip().startswith('REG'):
            res.setdefault(cur, []).append(' '.join(line.split()))
            cur = None
    return res

old, new = split_sass(work + '/old.sass'), split_sass(work + '/new.sass')
ro, rn = split_res(work + '/old.res'), split_res(work + '/new.res')
names = sorted(set(old) | set(new))
bad = same = 0
for n in names:
    if n not in old: print('only-new', n); bad += 1; continue
    if n not in new: print('only-old', n); bad += 1; continue
    a = sorted(map(tuple, old[n])); b = sorted(map(tuple, new[n]))  # each body in order; copies sorted
    if a != b:
        print('differs', n); bad += 1
    elif sorted(ro.get(n, [])) != sorted(rn.get(n, [])):  # the same instructions, other resources
        print('resources', n, '|', ' / '.join(ro.get(n, [])), '->', ' / '.join(rn.get(n, []))); bad += 1
    else:
        print('same', n); same += 1
print(f'{same} same, {bad} different (instructions or resources) or missing, of {len(names)} functions')
sys.exit(1 if bad else 0)
PY
