#!/usr/bin/env bash
# The .rpm test, on Debian (its rpm and rpmlint packages): builds the x86_64 .rpm
# (packaging/build-rpm.sh), reads its header (`rpm -qip`: name, version, architecture; the
# requirements: glibc 2.28, no NVML), runs rpmlint (no errors), and installs it into an `rpm
# --root` tree: the files land where Rocky/RHEL expect them, the config is %config(noreplace),
# and an upgrade to a newer package keeps an edited config. Scriptlets are not run there (no
# systemd in the tree); they are plain shell, checked with `sh -n`.
#
#   packaging/test-rpm.sh [WORKDIR]
#
# Run by .ci/run. Needs what build-rpm.sh needs, rpm and rpmlint.
set -euo pipefail
cd "$(dirname "$0")/.."
fail() {
    echo "FAIL: $*" >&2
    exit 1
}
say() { echo "== $*"; }
for tool in cargo-generate-rpm rpm rpmlint; do
    command -v "$tool" >/dev/null || fail "$tool not found (.ci/run installs it)"
done
WORK=${1:-$(mktemp -d /var/tmp/gpuguard-rpm-test.XXXXXX)}
rm -rf "$WORK"
mkdir -p "$WORK"

say "build the .rpm, and a newer one for the upgrade"
RPM1=$(packaging/build-rpm.sh "$WORK/rpm" | tail -n 1)
[ -f "$RPM1" ] || fail "no .rpm: $RPM1"
VERSION1=$(rpm -qp --qf '%{VERSION}' "$RPM1")
mkdir -p "$WORK/rpm2"
# The same package, its version raised (cargo-generate-rpm reads the version from Cargo.toml;
# -s overrides the metadata).
SOURCE_DATE_EPOCH=$(git log -1 --format=%ct) cargo generate-rpm \
    --target x86_64-unknown-linux-gnu --output "$WORK/rpm2" --payload-compress xz \
    --auto-req disabled -s "version = \"$VERSION1.1\"" >&2
RPM2=$(ls "$WORK"/rpm2/gpuguard-*.rpm)
echo "   $RPM1"
echo "   $RPM2"

say "header"
rpm -qip "$RPM1" | sed 's/^/   /'
[ "$(rpm -qp --qf '%{NAME} %{ARCH}' "$RPM1")" = "gpuguard x86_64" ] || fail "name/arch: $(rpm -qp --qf '%{NAME} %{ARCH}' "$RPM1")"
REQUIRES=$(rpm -qp --requires "$RPM1")
echo "$REQUIRES" | sed 's/^/   requires: /'
grep -qx 'glibc >= 2.28' <<<"$REQUIRES" || fail "glibc >= 2.28 not required"
grep -qi nvidia <<<"$REQUIRES" && fail "requires NVML (it is dlopen'ed)"
FLAGS=$(rpm -qp --qf '[%{FILENAMES} %{FILEFLAGS:fflags}\n]' "$RPM1")
grep -qx '/etc/gpuguard/config.toml cn' <<<"$FLAGS" || fail "config.toml is not %config(noreplace): $(grep config.toml <<<"$FLAGS")"
for f in post preun postun; do sh -n "packaging/rpm-scripts/$f" || fail "scriptlet $f"; done

say "rpmlint"
RPMLINT_RC=0
rpmlint -c packaging/rpmlint.toml "$RPM1" >"$WORK/rpmlint.log" 2>&1 || RPMLINT_RC=$?
sed 's/^/   /' "$WORK/rpmlint.log"
grep -qE '^ *[0-9]+ packages and [0-9]+ specfiles checked; 0 errors' "$WORK/rpmlint.log" ||
    fail "rpmlint reported errors (exit $RPMLINT_RC)"

say "install into an rpm --root tree, edit the config, upgrade"
ROOT=$WORK/root
mkdir -p "$ROOT"
rpm --root "$ROOT" --initdb
rpm --root "$ROOT" -i --nodeps --noscripts "$RPM1"
for path in /usr/bin/gpuguard /etc/gpuguard/config.toml /usr/lib/systemd/system/gpuguard.service \
    /usr/share/man/man1/gpuguard.1.gz /usr/share/bash-completion/completions/gpuguard \
    /usr/share/doc/gpuguard/docs/configuration.md /usr/share/licenses/gpuguard/LICENSE; do
    [ -e "$ROOT$path" ] || fail "$path not installed"
done
[ "$(rpm --root "$ROOT" -q --configfiles gpuguard)" = /etc/gpuguard/config.toml ] ||
    fail "configfiles: $(rpm --root "$ROOT" -q --configfiles gpuguard)"
"$ROOT/usr/bin/gpuguard" check-config --portable "$ROOT/etc/gpuguard/config.toml" >/dev/null ||
    fail "the packaged config does not check"
echo '# edited by the operator' >>"$ROOT/etc/gpuguard/config.toml"
rpm --root "$ROOT" -U --nodeps --noscripts "$RPM2"
[ "$(rpm --root "$ROOT" -q --qf '%{VERSION}' gpuguard)" = "$VERSION1.1" ] || fail "not upgraded"
grep -q '^# edited by the operator' "$ROOT/etc/gpuguard/config.toml" ||
    fail "the upgrade replaced the edited config"
[ ! -e "$ROOT/etc/gpuguard/config.toml.rpmnew" ] || fail "an .rpmnew for an unchanged packaged config"
echo "   installed, config kept across the upgrade"
rm -rf "$WORK"
