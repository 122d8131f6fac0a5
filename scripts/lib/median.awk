# Reads benchmark lines of KEY=VALUE fields (one line per run, the same fields in
# the same order on each) and prints one "median KEY=VALUE ..." line: per field,
# the median of its values (the lower middle one for an even number of runs).
{ for (i = 1; i <= NF; i++) { split($i, kv, "="); key[i] = kv[1]; val[i, NR] = kv[2] } nf = NF }
END {
    line = "median"
    for (i = 1; i <= nf; i++) {
        n = 0; for (r = 1; r <= NR; r++) v[++n] = val[i, r]
        for (a = 1; a <= n; a++) for (b = a + 1; b <= n; b++) if (v[b] + 0 < v[a] + 0) { t = v[a]; v[a] = v[b]; v[b] = t }
        line = line " " key[i] "=" v[int((n + 1) / 2)]
    }
    print line
}
