#!/usr/bin/env bash
# dev/sass_diff.sh A.so B.so - compares the device code (sm_90 SASS) of two builds of the
# cuda plugin (build/libshadowkv-cuda.so.0), kernel by kernel: for a reorganisation of
# cuda/ that must not change any kernel's instruction stream.
#
# Each function's SASS (cuobjdump -sass), with its encodings (so the scheduling control
# bits count too) and its resource usage (cuobjdump -res-usage: registers, stack, shared
# and constant memory), is compared after normalising what a move between files changes
# by itself: the per-address comments (offsets from the function's start), the name of the
# file in a kernel's anonymous namespace (_GLOBAL__N__<hash>_<len>_<file>_cu_<hash> ->
# ANON; a kernel is known by the rest of its mangled name), the order of the functions and
# of the files' cubins, and relocated operands (global symbols' addresses, should any
# appear). Prints one line per function, "same", "differs" (its SASS), "res-only" (the
# same SASS, other resource usage), "only in A" or "only in B". The PTX the plugin also
# carries (compute_90, compiled at load time on newer GPUs) is compared per function too,
# with the label numbers (which follow a function's place in its file) normalised: only
# the functions whose PTX differs are listed ("ptx-differs"). Ends with a summary line;
# exits 1 unless every function is the same in both.
#
# Needs cuobjdump and nvdisasm (the CUDA toolkit's, or PyPI's nvidia-cuda-cuobjdump and
# nvidia-cuda-nvdisasm) on PATH, or CUOBJDUMP=/path/to/cuobjdump. No GPU needed.
#   make SKV_CUDA=1 build/libshadowkv-cuda.so.0      (in a copy at the base commit, and here)
#   bash dev/sass_diff.sh ../base/build/libshadowkv-cuda.so.0 build/libshadowkv-cuda.so.0
# SASS_DIFF_SHOW=1 prints a unified diff of each function that differs.
set -euo pipefail
if [ $# -ne 2 ]; then echo "usage: $0 A.so B.so" >&2; exit 2; fi
CUOBJDUMP=${CUOBJDUMP:-$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)}
[ -x "$CUOBJDUMP" ] || { echo "sass_diff: no cuobjdump (set CUOBJDUMP)" >&2; exit 2; }
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
for i in 1 2; do
  f=${!i}
  [ -f "$f" ] || { echo "sass_diff: no file $f" >&2; exit 2; }
  "$CUOBJDUMP" -sass "$f" > "$TMP/$i.sass"
  "$CUOBJDUMP" -res-usage "$f" > "$TMP/$i.res"
  "$CUOBJDUMP" -ptx "$f" > "$TMP/$i.ptx"
done
python3 - "$TMP" "$1" "$2" <<'PY'
import difflib, os, re, sys
tmp, name_a, name_b = sys.argv[1:4]
ANON = re.compile(r'\d+_GLOBAL__N__[0-9a-f]{8}_\d+_\w+?_cu_[0-9a-f]{8}')
ADDR = re.compile(r'^\s*/\*[0-9a-f]{4,}\*/\s*')
RELOC = re.compile(r'(c\[0x[1-9a-f]\]\[)0x[0-9a-f]+(\])|(\d+@(?:lo|hi)\()[^)]*(\))|(CALL\.ABS\S*\s+)0x[0-9a-f]+')
ENC = re.compile(r'/\* 0x[0-9a-f]{16} \*/')

def norm_name(n):
    return ANON.sub('ANON', n)

def add(funcs, name, body):
    k, i = name, 2
    while k in funcs:  # the same (normalised) name in two cubins: keep both, in file order
        k, i = '%s #%d' % (name, i), i + 1
    funcs[k] = body

def sass(path):
    funcs, name, body = {}, None, []
    relocated = False
    for line in open(path):
        m = re.match(r'\s*Function : (\S+)', line)
        if m or re.match(r'\s*(\.section|code for|Fatbin|\.target|=====)', line):
            if name is not None: add(funcs, name, body)
            name, body = (norm_name(m.group(1)), []) if m else (None, [])
            continue
        if name is None or not line.strip(): continue
        line = ADDR.sub('', line.rstrip())
        if line.lstrip().startswith('/* 0x'):  # the second encoding word of an instruction
            body.append(('' if relocated else line.strip()))
            continue
        relocated = bool(RELOC.search(line))
        if relocated:  # a relocated operand: compare the instruction without it or its encoding
            line = ENC.sub('', RELOC.sub(lambda m: ''.join(g for g in m.groups() if g and not g.startswith('0x')) + 'RELOC', line))
        body.append(re.sub(r'\s+', ' ', line.strip()))
    if name is not None: add(funcs, name, body)
    return funcs

def res(path):
    out, name = {}, None
    for line in open(path):
        m = re.match(r'\s*Function (\S+):', line)
        if m:
            name = norm_name(m.group(1)); continue
        if name and line.strip().startswith(('REG:', 'STACK:', 'SHARED:')):
            k = name
            i = 2
            while k in out: k, i = '%s #%d' % (name, i), i + 1
            out[k] = ' '.join(line.split()); name = None
    return out

INTERNAL = re.compile(r'\d+_INTERNAL_[0-9a-f]{8}_\d+_\w+?_cu_[0-9a-f]{6}')
LABEL = re.compile(r'\$L__(BB|tmp|func_begin|func_end)\d+')

def ptx(path):
    text = LABEL.sub(r'$L__\1', INTERNAL.sub('INTERNAL', norm_name(open(path).read())))
    funcs = {}
    for part in re.split(r'\n(?=(?:\.visible |\.weak )?\.(?:entry|func) )', text)[1:]:
        m = re.match(r'(?:\.visible |\.weak )?\.(?:entry|func)\s+(?:\([^)]*\)\s*)?(\S+?)\(', part)
        if not m: continue
        body = [l.strip() for l in part.split('\n}\n')[0].split('\n') if l.strip() and not l.strip().startswith('//')]
        while body and body[-1] == '}': body.pop()
        add(funcs, m.group(1), body)
    return funcs

A, B = sass(os.path.join(tmp, '1.sass')), sass(os.path.join(tmp, '2.sass'))
PA, PB = ptx(os.path.join(tmp, '1.ptx')), ptx(os.path.join(tmp, '2.ptx'))
RA, RB = res(os.path.join(tmp, '1.res')), res(os.path.join(tmp, '2.res'))
show = os.environ.get('SASS_DIFF_SHOW') == '1'
n = {'same': 0, 'differs': 0, 'res-only': 0, 'only in A': 0, 'only in B': 0}
for k in sorted(set(A) | set(B)):
    if k not in B: st = 'only in A'
    elif k not in A: st = 'only in B'
    elif A[k] != B[k]: st = 'differs'
    elif RA.get(k) != RB.get(k): st = 'res-only'
    else: st = 'same'
    n[st] += 1
    print('%-9s %s' % (st, k))
    if st == 'res-only' or (st == 'differs' and RA.get(k) != RB.get(k)):
        print('  resources A: %s\n  resources B: %s' % (RA.get(k), RB.get(k)))
    if st == 'differs' and show:
        sys.stdout.writelines(l + '\n' for l in difflib.unified_diff(A[k], B[k], 'A', 'B', lineterm='', n=2))
p_same = 0
for k in sorted(set(PA) | set(PB)):
    if PA.get(k) == PB.get(k):
        p_same += 1
    else:
        print('ptx-%s %s' % ('differs' if k in PA and k in PB else 'only-in-' + ('A' if k in PA else 'B'), k))
        if show and k in PA and k in PB:
            sys.stdout.writelines(l + '\n' for l in difflib.unified_diff(PA[k], PB[k], 'A', 'B', lineterm='', n=2))
p_all = len(set(PA) | set(PB))
print('sass_diff: %d functions: %d same, %d differ in SASS, %d in resource usage only, %d only in A (%s), '
      '%d only in B (%s); PTX: %d of %d functions the same'
      % (sum(n.values()), n['same'], n['differs'], n['res-only'], n['only in A'], name_a, n['only in B'], name_b,
         p_same, p_all))
sys.exit(0 if n['same'] == sum(n.values()) and p_same == p_all else 1)
PY
